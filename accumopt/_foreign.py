"""A framework stepping the wrapper with its own gradient accumulation on (Accelerate's
``gradient_accumulation_steps``, a HF ``Trainer``'s, Lightning's ``accumulate_grad_batches``):
every update would be a fraction of the right one. Found at the boundary ``step()`` on the
call stack, by duck typing, so that no framework is imported."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accumopt.accumulate import AccumulatingOptimizer

FOREIGN_ACCUMULATION = (
    "Accumulate: the wrapper is stepped by {name} with its own gradient accumulation on "
    "({steps} steps: the framework divides each loss by {steps} and steps once per {steps} "
    "batches) on top of the wrapper's window, so every update would be 1/{steps} of the right "
    "one (or the window would hold {steps} times the micro-batches). Nothing was applied; "
    "expected the framework's accumulation off (gradient_accumulation_steps=1) and the "
    "window in Accumulate only, or the adapter in "
    "accumopt.integrations. Call opt.discard() after changing the configuration."
)


def accumulation(opt: AccumulatingOptimizer) -> str | None:
    """Why the boundary ``step()`` must not apply: a framework that accumulates on its own is
    stepping ``opt``: Accelerate's ``AcceleratedOptimizer`` (a ``gradient_state`` of
    ``num_steps`` > 1), a HF ``Trainer`` (``args.gradient_accumulation_steps`` > 1) whose
    optimizer is ``opt`` or wraps it, a Lightning loop whose ``trainer`` has
    ``accumulate_grad_batches`` > 1 and ``opt`` among its optimizers. Found on the call stack
    by duck typing, so no framework is imported; None otherwise."""
    frame = sys._getframe(2)
    # Who calls step(), past accumopt's and torch's own wrappers (a scheduler's, GradScaler's):
    # unless a framework, none steps the wrapper (each frame costs ~1 us: built on demand)
    for _ in range(6):
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("accumopt.", "torch.")) or frame.f_back is None:
            break
        frame = frame.f_back
    if frame.f_globals.get("__name__", "").partition(".")[0] not in _FRAMEWORKS:
        return None
    for _ in range(12):
        # only the frameworks' own frames: reading f_locals snapshots a frame's locals into
        # it (before Python 3.13), which would keep a caller's objects alive
        if (framework := frame.f_globals.get("__name__", "").partition(".")[0]) in _FRAMEWORKS:
            name, steps = _accumulation_steps(frame.f_locals.get("self"), opt)
            if isinstance(steps, int) and steps > 1:
                return FOREIGN_ACCUMULATION.format(name=f"{name} ({framework})", steps=steps)
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


_FRAMEWORKS = ("accelerate", "transformers", "lightning", "pytorch_lightning")


def _accumulation_steps(owner: object, opt: object) -> tuple[str, object]:
    """The framework object stepping ``opt`` from ``owner`` (its class name) and its
    accumulation setting (None: not one)."""
    held = _attr(owner, "optimizer")
    if held is opt or (held is not None and _attr(held, "optimizer") is opt):
        steps = _attr(_attr(owner, "gradient_state"), "num_steps")
        if steps is None:
            steps = _attr(_attr(owner, "args"), "gradient_accumulation_steps")
        return type(owner).__name__, steps
    trainer = _attr(owner, "trainer")
    optimizers = _attr(trainer, "optimizers")
    if isinstance(optimizers, list) and any(o is opt for o in optimizers):
        return type(trainer).__name__, _attr(trainer, "accumulate_grad_batches")
    return "", None


def _attr(obj: object, name: str) -> Any:
    """``getattr(obj, name, None)``, also where a property raises (a detached module)."""
    if obj is None:
        return None
    try:
        return getattr(obj, name, None)
    except Exception:  # a framework property that raises when unset
        return None

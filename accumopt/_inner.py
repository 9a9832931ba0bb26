"""The optimizer step hooks accumopt relies on: the inner optimizer's real steps, as a
post-step hook sees them, and whether step hooks exist at all.

torch runs an optimizer's post-step hooks after its update, its own ones first, then the global
ones (``register_optimizer_step_post_hook``): when ``inner.step()`` raises, a count taken by a
hook that runs first tells whether the update was applied (a later hook raised) or not (the
step itself failed), so the wrapper never applies one window twice.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from accumopt._guards import STEPPED_DIRECTLY


def any_step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether step hooks would run around ``opt.step()`` (its own, or global ones): then the
    wrapper's step goes through torch's hook-running wrapper."""
    return bool(
        opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or _global_optimizer_pre_hooks
        or _global_optimizer_post_hooks
    )


def watch_steps(inner: torch.optim.Optimizer, owner: object) -> list[int]:
    """A one-element list counting ``inner``'s completed updates, kept by a post-step hook
    moved to the front of ``inner``'s post hooks (so before every other post hook: torch runs
    the global ones after the optimizer's own) and removed when ``owner`` is freed.

    A pre-step hook refuses a step of ``inner`` that ``owner`` did not start (its
    ``_inner_stepping`` is False): the inner optimizer stepped directly, on a partial window.
    """
    steps = [0]
    ref = weakref.ref(owner)

    def count(*_: object) -> None:
        steps[0] += 1

    def refuse_others(optimizer: torch.optim.Optimizer, *_: object) -> None:
        wrapper = ref()
        if wrapper is not None and not getattr(wrapper, "_inner_stepping", True):
            raise RuntimeError(STEPPED_DIRECTLY.format(name=type(optimizer).__name__))

    handle = inner.register_step_post_hook(count)
    inner._optimizer_step_post_hooks.move_to_end(handle.id, last=False)  # type: ignore[attr-defined]
    pre = inner.register_step_pre_hook(refuse_others)
    weakref.finalize(owner, handle.remove)
    weakref.finalize(owner, pre.remove)
    return steps

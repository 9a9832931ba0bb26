"""Hugging Face Accelerate with accumopt: ``prepare(accelerator, model, Accumulate(opt), ...)``.

Use :func:`prepare` where you would call ``accelerator.prepare``; it returns the same objects
and wires the :class:`~accumopt.Accumulate` wrappers among the prepared optimizers to
Accelerate::

    from accumopt import Accumulate
    from accumopt.integrations import accelerate as accumopt_accelerate

    accelerator = Accelerator()                  # gradient_accumulation_steps=1 (the default)
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=3e-4), every=8)
    model, optimizer, loader, sched = accumopt_accelerate.prepare(
        accelerator, model, opt, loader, sched)
    for batch in loader:
        loss_sum = loss_fn(model(batch["x"]), batch["y"], reduction="sum")
        opt.next_items(batch["y"].numel())   # this rank's items; the update is the mean over
        accelerator.backward(loss_sum)       # every rank's items together
        optimizer.step()                     # steps the inner optimizer at the boundary only
        sched.step()                         # AcceleratedScheduler: on real updates only
        optimizer.zero_grad()
    if opt.flush():                          # the short last window, exact
        sched.step()

What the wiring does:

- **DDP**: ``opt.set_model(prepared_model)``, so micro-steps inside a window skip DDP's
  all-reduce (one gradient all-reduce per update) and item counts are summed over the ranks.
  Done for whichever call brings the model and the optimizer, in one ``prepare`` or several.
- **Schedulers**: the prepared optimizer reports ``step_was_skipped`` for every micro-step that
  did not update, so ``AcceleratedScheduler.step()`` (and ``accelerator.optimizer_step_was_
  skipped``) follow real updates only, as in the loop without accumulation.
- **Checkpoints**: ``accelerator.save_state`` writes ``optimizer.bin`` from the main process
  only, but mid-window each rank holds its own partial gradient (nothing is synchronised inside
  a window); every rank also writes ``accumopt_window_{i}_rank{r}.pt`` and ``load_state`` reads
  its own back, so a run saved mid-window resumes bit for bit.
- **Refusals** (before any wrong update): Accelerate's own accumulation
  (``gradient_accumulation_steps > 1``: ``accelerator.backward`` divides every loss by it and
  the optimizer skips steps, so with ``Accumulate`` every update would be ``1/steps`` of the
  right one), DeepSpeed / FSDP / Megatron-LM / XLA (they own the gradients),
  ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` on a window's partial gradient, and,
  on several processes, a step of a wrapper whose DDP model was prepared without this helper.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from accumopt.accumulate import AccumulatingOptimizer
from accumopt.distributed import is_distributed

try:
    from accelerate.optimizer import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        AcceleratedOptimizer,
    )
except ImportError as err:  # importable without it (doctest collection); prepare() says so
    _MISSING: ImportError | None = err
    AcceleratedOptimizer = object
else:
    _MISSING = None

__all__ = ["AcceleratedAccumulate", "check_accumulation_steps", "prepare"]

_WIRED = "_accumopt_hooks"  # attribute on the Accelerator: its save/load hooks are installed
_MODELS = "_accumopt_models"  # attribute on the Accelerator: the models prepare() returned
_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "FSDP", "XLA")


def check_accumulation_steps(steps: int, where: str) -> None:
    """Refuse Accelerate's own gradient accumulation next to :class:`~accumopt.Accumulate`.

    Args:
        steps: ``accelerator.gradient_accumulation_steps`` (an int; 1 means off).
        where: what is being checked, for the message (e.g. ``"prepare"``).

    Raises:
        ValueError: ``steps`` is not 1. With it, ``accelerator.backward`` divides every loss by
            ``steps`` and the prepared optimizer skips ``steps - 1`` of every ``steps`` calls,
            while ``Accumulate`` averages over its own window too: every update would be
            ``1/steps`` of the right one.
    """
    if steps != 1:
        raise ValueError(
            f"accumopt.integrations.accelerate ({where}): the Accelerator accumulates "
            f"gradients itself (gradient_accumulation_steps={steps}): accelerator.backward "
            f"divides every loss by {steps} and the optimizer steps once per {steps} calls, "
            f"while Accumulate averages over its own window as well, so every update would "
            f"be 1/{steps} of the right one. Expected gradient_accumulation_steps=1 (the "
            "default) with Accumulate. Build the Accelerator without gradient_accumulation_"
            "steps / GradientAccumulationPlugin (and unset ACCELERATE_GRADIENT_ACCUMULATION_"
            f"STEPS), and give the window to Accumulate instead: Accumulate(opt, every={steps})."
            " `with accelerator.accumulate(model):` is then harmless and can stay."
        )


class AcceleratedAccumulate(AcceleratedOptimizer):  # type: ignore[misc]
    """Accelerate's ``AcceleratedOptimizer`` around an :class:`~accumopt.Accumulate` wrapper.

    :func:`prepare` gives the optimizer that ``accelerator.prepare`` returns this class (same
    object, same state); nothing is built by hand. ``.optimizer`` is the ``Accumulate``.
    Differences from ``AcceleratedOptimizer``:

    - :meth:`step` refuses to run while the Accelerator accumulates itself;
    - :attr:`step_was_skipped` is True after every ``step()`` that did not update the
      parameters (inside a window, or a window skipped for inf/NaN under AMP);
    - :meth:`load_state_dict` called by ``accelerator.load_state`` takes this rank's open
      window from the per-rank file :func:`prepare`'s save hook wrote.
    """

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``AcceleratedOptimizer.step``: under Accelerate's scaler ``scaler.step(opt)`` and
        ``scaler.update()``, else ``opt.step(closure)``; the inner optimizer steps only at the
        window's boundary (``opt.did_update``).

        Raises:
            RuntimeError: the Accelerator's ``gradient_accumulation_steps`` was changed from 1
                after :func:`prepare` (checked before anything is stepped; the open window
                holds gradients of losses Accelerate divided, ``opt.discard()`` drops it);
                several processes, but the ``Accumulate`` never learnt the DDP model (it
                was prepared by ``accelerator.prepare`` after this optimizer).
        """
        try:
            check_accumulation_steps(self.gradient_state.num_steps, "optimizer.step()")
        except ValueError as err:
            raise RuntimeError(
                f"{err} Nothing was stepped; opt.discard() drops the window."
            ) from None
        if self.accelerator_state.num_processes > 1 and not is_distributed(self.optimizer.model):
            raise RuntimeError(
                "accumopt.integrations.accelerate (optimizer.step()): several processes, but "
                "the Accumulate wrapper was never told the DDP model, so every micro-step "
                "all-reduces and items are not summed over the ranks; expected the model to "
                "go through accumopt.integrations.accelerate.prepare as well (in the same call "
                "or another one, before training). Nothing was stepped."
            )
        return super().step(closure)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` left the parameters unchanged (a bool): inside a window,
        a window skipped for inf/NaN, or Accelerate's scaler skipping the step."""
        return bool(self._is_overflow) or not self.optimizer.did_update

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (what ``state_dict()`` returned) into the ``Accumulate``; within
        ``accelerator.load_state`` on several processes, with this rank's own open window.

        Raises:
            RuntimeError: a checkpoint saved mid-window on several processes lacks this rank's
                window file, or the file belongs to another checkpoint or world size.
            ValueError, TypeError: from ``Accumulate.load_state_dict`` (settings or shapes
                that differ from the checkpoint's).
        """
        own = self.__dict__.pop("_accumopt_window", None)
        if own is not None:
            state_dict = _with_rank_window(state_dict, *own)
        super().load_state_dict(state_dict)


def prepare(accelerator: Any, *objects: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*objects)``, with every :class:`~accumopt.Accumulate` wired in.

    Pass the ``Accumulate`` wrapper (not the bare inner optimizer) with the model, data
    loaders and LR schedulers, in one call or several (the wiring is done for whatever has been
    prepared so far). Objects come back as from ``accelerator.prepare``.

    Args:
        accelerator: an ``accelerate.Accelerator`` with ``gradient_accumulation_steps=1`` and
            a plain or DDP setup (CPU or GPU, any mixed precision).
        *objects: models, optimizers (``Accumulate`` wrappers), data loaders, schedulers.
        device_placement: forwarded to ``accelerator.prepare``.

    Returns:
        What ``accelerator.prepare`` returns: one object, or a tuple in the order given. Each
        ``Accumulate`` comes back inside an :class:`AcceleratedAccumulate`; keep your own
        reference to the ``Accumulate`` for ``next_items``, ``flush`` and ``did_update``.

    Raises:
        ImportError: Hugging Face Accelerate is not installed.
        ValueError: the Accelerator accumulates itself (``gradient_accumulation_steps`` != 1,
            see :func:`check_accumulation_steps`); it uses DeepSpeed, FSDP, Megatron-LM or
            XLA; an ``Accumulate`` holds parameters of more than one prepared model.
        RuntimeError: from ``Accumulate.set_model``: the wrapper has an open window (prepare
            between windows).
    """
    if _MISSING is not None:
        raise ImportError(
            "accumopt.integrations.accelerate needs Hugging Face Accelerate, which is not "
            'installed: pip install "accumopt[accelerate]" (or pip install accelerate).'
        ) from _MISSING
    wrapped = [o for o in objects if isinstance(o, AccumulatingOptimizer)]
    if wrapped or _accumulators(accelerator):
        _check_setup(accelerator)
    prepared = accelerator.prepare(*objects, device_placement=device_placement)
    models = accelerator.__dict__.setdefault(_MODELS, weakref.WeakSet())
    models.update(
        o for o in (prepared if len(objects) > 1 else (prepared,)) if isinstance(o, nn.Module)
    )
    _wire(accelerator, models)
    return prepared


def _check_setup(accelerator: Any) -> None:
    check_accumulation_steps(accelerator.gradient_accumulation_steps, "prepare")
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _UNSUPPORTED or getattr(accelerator, "is_fsdp2", False):
        raise ValueError(
            f"accumopt.integrations.accelerate (prepare): the Accelerator uses {kind}"
            f"{' (FSDP2)' if kind not in _UNSUPPORTED else ''}, which owns the gradients and "
            "their accumulation; expected no distribution or DDP (MULTI_GPU, MULTI_CPU, ...). "
            "Use that engine's own accumulation, or DDP through Accelerate with Accumulate "
            "(FSDP2 without Accelerate: Accumulate(opt, model=fully_shard(net)))."
        )


def _accumulators(accelerator: Any) -> list[Any]:
    """The prepared optimizers of ``accelerator`` that wrap an ``Accumulate``."""
    return [
        o
        for o in accelerator._optimizers
        if isinstance(o, AcceleratedOptimizer) and isinstance(o.optimizer, AccumulatingOptimizer)
    ]


def _wire(accelerator: Any, models: Iterable[nn.Module]) -> None:
    """Give each prepared ``Accumulate`` its prepared model and Accelerate its hooks."""
    found = _accumulators(accelerator)
    for prepared in found:
        if not isinstance(prepared, AcceleratedAccumulate):
            prepared.__class__ = AcceleratedAccumulate  # same object: Accelerate's lists hold it
        opt = prepared.optimizer
        owner = _owner(opt, models)
        if owner is None and accelerator.num_processes > 1 and _owner(opt, accelerator._models):
            raise ValueError(
                "accumopt.integrations.accelerate (prepare): the Accumulate wrapper's model was "
                "prepared by accelerator.prepare itself, which keeps no reference to the DDP "
                "module it returned, so the wrapper cannot synchronise through it (every "
                "micro-step would all-reduce, and items would not be summed over the ranks). "
                "Expected the model to go through accumopt.integrations.accelerate.prepare "
                "too, in this call or an earlier one."
            )
        if owner is not None and opt.model is not owner:
            opt.set_model(owner)
    if found and not getattr(accelerator, _WIRED, False):
        accelerator.register_save_state_pre_hook(_save_hook(accelerator))
        accelerator.register_load_state_pre_hook(_load_hook(accelerator))
        _guard_clipping(accelerator)
        setattr(accelerator, _WIRED, True)


def _owner(opt: AccumulatingOptimizer, models: Iterable[nn.Module]) -> nn.Module | None:
    """The one prepared model holding ``opt``'s parameters (None: not prepared yet)."""
    mine = {id(p) for g in opt.param_groups for p in g["params"]}
    owners = [m for m in models if any(id(p) in mine for p in m.parameters())]
    if len(owners) > 1:
        names = ", ".join(type(m).__name__ for m in owners)
        raise ValueError(
            f"accumopt.integrations.accelerate (prepare): the Accumulate wrapper holds "
            f"parameters of {len(owners)} prepared models ({names}); "
            "expected one (Accumulate counts micro-steps and synchronises DDP through one "
            "model). Wrap the models in one nn.Module, or use one Accumulate per model."
        )
    return owners[0] if owners else None


def _window_file(folder: str, index: int, rank: int) -> str:
    return os.path.join(folder, f"accumopt_window_{index}_rank{rank}.pt")


def _save_hook(accelerator: Any) -> Callable[..., None]:
    def save(models: Any, weights: Any, output_dir: str) -> None:
        """Every rank: its own window (``optimizer.bin`` holds the main process's only)."""
        if accelerator.num_processes == 1:
            return  # optimizer.bin holds the whole window
        rank, world = accelerator.process_index, accelerator.num_processes
        for i, prepared in enumerate(accelerator._optimizers):
            if isinstance(prepared, AcceleratedAccumulate):
                entry = prepared.optimizer.state_dict()["accumopt"]
                own = {"rank": rank, "world_size": world, "accumopt": entry}
                torch.save(own, _window_file(output_dir, i, rank))

    return save


def _load_hook(accelerator: Any) -> Callable[..., None]:
    def load(models: Any, input_dir: str) -> None:
        """Every rank: hand its window file to the optimizer about to be loaded."""
        if accelerator.num_processes == 1:
            return
        rank, world = accelerator.process_index, accelerator.num_processes
        for i, prepared in enumerate(accelerator._optimizers):
            if isinstance(prepared, AcceleratedAccumulate):
                path = _window_file(input_dir, i, rank)
                saved = (
                    torch.load(path, map_location="cpu", weights_only=True)
                    if os.path.exists(path)
                    else None
                )
                prepared.__dict__["_accumopt_window"] = (saved, path, rank, world)

    return load


def _with_rank_window(
    state: dict[str, Any], saved: dict[str, Any] | None, path: str, rank: int, world: int
) -> dict[str, Any]:
    """``state`` (the main process's) with this rank's own ``"accumopt"`` entry."""
    main = state.get("accumopt") if isinstance(state, dict) else None
    if saved is None:
        if main is not None and main.get("window") is not None:
            raise RuntimeError(
                f"accumopt.integrations.accelerate (load_state): the checkpoint was saved in the "
                f"middle of an accumulation window on several processes, but {path} (rank "
                f"{rank}'s own window) is missing; optimizer.bin holds the main process's "
                "partial gradient only, and loading it on every rank would train on the wrong "
                "sum. Expected a checkpoint written by accelerator.save_state after "
                "accumopt.integrations.accelerate.prepare, on the same number of processes. "
                "Load one saved at a window boundary, or resume from the previous checkpoint."
            )
        return state
    entry = saved["accumopt"]
    if (
        saved["world_size"] != world
        or saved["rank"] != rank
        or main is None
        or (entry.get("updates") != main.get("updates"))
    ):
        raise RuntimeError(
            f"accumopt.integrations.accelerate (load_state): {path} was written by rank "
            f"{saved['rank']} of {saved['world_size']} after {entry.get('updates')} updates, "
            f"but it is loaded on rank {rank} of {world} next to an optimizer.bin at "
            f"{None if main is None else main.get('updates')} updates; expected the same "
            "checkpoint and number of processes. Load the whole checkpoint folder as "
            "accelerator.save_state wrote it, on as many processes."
        )
    return {**state, "accumopt": entry}


def _guard_clipping(accelerator: Any) -> None:
    """Make ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` refuse a partial window."""
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        original = getattr(accelerator, name)

        def guarded(
            parameters: Any, *args: Any, _clip: Any = original, _name: str = name, **kw: Any
        ) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            ids = {id(p) for p in params}
            for prepared in _accumulators(accelerator):
                opt = prepared.optimizer
                open_window = opt.micro_step > 0 and not opt.will_update
                if open_window and any(id(p) in ids for g in opt.param_groups for p in g["params"]):
                    raise RuntimeError(
                        f"accelerator.{_name} was called on micro-step {opt.micro_step} of an "
                        "open accumulation window: .grad holds a partial sum there, and "
                        "clipping it would change the update (accelerator.sync_gradients is "
                        "True on every micro-step with gradient_accumulation_steps=1). Expected "
                        "clipping at the boundary only: Accumulate(..., max_grad_norm=...) "
                        "clips the window's gradient once, or clip under `if opt.will_update:`."
                        " Nothing was clipped."
                    )
            return _clip(params, *args, **kw)

        setattr(accelerator, name, guarded)

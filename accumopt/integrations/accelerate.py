"""Hugging Face Accelerate with accumopt: call :func:`prepare` where you would call
``accelerator.prepare`` (docs/frameworks/accelerate.md, ``examples/accelerate_digits.py``).
Each rank saves its window beside ``optimizer.bin`` (``accumopt_window_{i}_rank{r}.pt``) for
``load_state``."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped, import-not-found, unused-ignore]
from torch import nn

from accumopt import Accumulate, checkpoint_position
from accumopt.distributed import is_distributed

__all__ = ["AcceleratedAccumulate", "prepare"]

_WHERE = "accumopt.integrations.accelerate"
_MODELS = "_accumopt_models"  # attribute on the Accelerator: the models prepare() returned
_UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM", "FSDP", "XLA")


def _own_accumulation(steps: int, where: str) -> str:
    return (
        f"{_WHERE} ({where}): the Accelerator accumulates (gradient_accumulation_steps={steps}): "
        f"each update would be 1/{steps} of the right one. Expected gradient_accumulation_steps=1 "
        f"(no plugin or environment variable) and Accumulate(opt, every={steps})."
    )


class AcceleratedAccumulate(AcceleratedOptimizer):  # type: ignore[misc]
    """Accelerate's ``AcceleratedOptimizer`` around an :class:`~accumopt.Accumulate`
    (``.optimizer``), built by :func:`prepare`."""

    _is_accelerate_prepared = True  # accelerator.prepare takes it as it is
    _rank_window: tuple[dict[str, Any] | None, str] | None = None  # from the load hook

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``AcceleratedOptimizer.step``. RuntimeError, stepping nothing, where the Accelerator
        accumulates itself, or on several processes the wrapper never got its DDP model."""
        steps = self.gradient_state.num_steps
        if steps != 1:
            why = _own_accumulation(steps, "optimizer.step()")
            raise RuntimeError(f"{why} Nothing was stepped; opt.discard() drops the window.")
        if self.accelerator_state.num_processes > 1 and not is_distributed(self.optimizer.model):
            raise RuntimeError(
                f"{_WHERE} (optimizer.step()): several processes, but the wrapper was never told "
                f"the DDP model; expected it to go through {_WHERE}.prepare. Nothing was stepped."
            )
        return super().step(closure)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` left the parameters unchanged (inside a window, inf/NaN)."""
        return bool(self._is_overflow) or not self.optimizer.did_update

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, in ``load_state`` with this rank's window (RuntimeError: missing or stale)."""
        own, self._rank_window = self._rank_window, None
        if own is not None:
            state_dict = _with_rank_window(state_dict, *own)
        super().load_state_dict(state_dict)


def prepare(accelerator: Any, *objects: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*objects)`` with every :class:`~accumopt.Accumulate` (not its inner
    optimizer) wired in, in one call or several: each comes back inside an
    :class:`AcceleratedAccumulate` and learns the prepared DDP model. From then on
    ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` refuse (RuntimeError) an open window.

    Raises:
        ValueError: ``gradient_accumulation_steps != 1``; DeepSpeed, FSDP, Megatron-LM or XLA;
            an fp16 GradScaler not given as ``Accumulate(..., scaler=accelerator.scaler)``; a
            wrapper prepared by plain ``accelerator.prepare``; one over several prepared models.
        RuntimeError: from ``Accumulate.set_model`` (a window is open).
    """
    wrappers = [o for o in objects if isinstance(o, Accumulate)]
    if wrappers or any(isinstance(o.optimizer, Accumulate) for o in accelerator._optimizers):
        _check_setup(accelerator, wrappers)
    given = [None] * len(objects) if device_placement is None else device_placement
    places = [accelerator.device_placement if p is None else p for p in given]
    if len(places) == len(objects):  # else accelerator.prepare raises
        objects = tuple(
            AcceleratedAccumulate(o, p, accelerator.scaler) if isinstance(o, Accumulate) else o
            for o, p in zip(objects, places)
        )
    result = accelerator.prepare(*objects, device_placement=device_placement)
    if _MODELS not in accelerator.__dict__:
        setattr(accelerator, _MODELS, weakref.WeakSet())
        _install_hooks(accelerator)
    models, out = getattr(accelerator, _MODELS), result if len(objects) > 1 else (result,)
    models.update(o for o in out if isinstance(o, nn.Module))
    for opt in _wrappers(accelerator):  # each gets the prepared model holding its parameters
        mine = {id(p) for g in opt.param_groups for p in g["params"]}
        owners = [m for m in models if any(id(p) in mine for p in m.parameters())]
        if len(owners) > 1:
            raise ValueError(
                f"{_WHERE} (prepare): an Accumulate holds parameters of {len(owners)} prepared "
                "models; expected one. Wrap them in one nn.Module, or use one Accumulate each."
            )
        if owners and opt.model is not owners[0]:  # none (or plain prepare's): step() refuses
            opt.set_model(owners[0])
    return result


def _check_setup(accelerator: Any, wrappers: list[Accumulate]) -> None:
    steps = accelerator.gradient_accumulation_steps
    if steps != 1:
        raise ValueError(_own_accumulation(steps, "prepare"))
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _UNSUPPORTED or getattr(accelerator, "is_fsdp2", False):
        raise ValueError(
            f"{_WHERE} (prepare): the Accelerator uses {kind}, which owns the gradients; expected "
            "no distribution or DDP. Use its own accumulation (or FSDP2 without Accelerate)."
        )
    if accelerator.scaler is not None and any(w.scaler is not accelerator.scaler for w in wrappers):
        raise ValueError(
            f"{_WHERE} (prepare): the Accelerator steps its GradScaler every micro-step; "
            "expected Accumulate(..., scaler=accelerator.scaler)."
        )
    for o in accelerator._optimizers:
        if isinstance(o.optimizer, Accumulate) and not isinstance(o, AcceleratedAccumulate):
            raise ValueError(
                f"{_WHERE} (prepare): an Accumulate was prepared by accelerator.prepare itself "
                f"(schedulers would step every micro-step); expected {_WHERE}.prepare."
            )


def _wrappers(accelerator: Any) -> list[Accumulate]:
    return [o.optimizer for o in accelerator._optimizers if isinstance(o, AcceleratedAccumulate)]


def _install_hooks(accelerator: Any) -> None:
    """Per-rank window files beside ``optimizer.bin`` (rank 0's), and clipping that refuses."""

    def files(folder: str) -> Iterable[tuple[AcceleratedAccumulate, str]]:
        rank = accelerator.process_index
        for i, o in enumerate(accelerator._optimizers):
            if isinstance(o, AcceleratedAccumulate) and accelerator.num_processes > 1:
                yield o, os.path.join(folder, f"accumopt_window_{i}_rank{rank}.pt")

    def save(models: Any, weights: Any, folder: str) -> None:
        for prepared, path in files(folder):
            group = prepared.optimizer.state_dict()["param_groups"][0]
            torch.save({k: v for k, v in group.items() if str(k).startswith("accumopt")}, path)

    def load(models: Any, folder: str) -> None:
        for prepared, path in files(folder):
            found = os.path.exists(path)
            saved = torch.load(path, map_location="cpu", weights_only=True) if found else None
            prepared._rank_window = (saved, path)

    def guarded(clip: Callable[..., Any]) -> Callable[..., Any]:  # refuses an open window
        def run(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            ids = {id(p) for p in params}
            for opt in _wrappers(accelerator):
                window = opt.micro_step and not opt.will_update
                if window and any(id(p) in ids for g in opt.param_groups for p in g["params"]):
                    raise RuntimeError(
                        f"{_WHERE}: accelerator.{clip.__name__} on micro-step {opt.micro_step} "
                        "of a window (.grad holds a partial sum); expected max_grad_norm=, or "
                        "`if opt.will_update:`. Nothing was clipped."
                    )
            return clip(params, *args, **kwargs)

        return run

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        setattr(accelerator, name, guarded(getattr(accelerator, name)))


def _with_rank_window(state: dict[str, Any], saved: dict[str, Any] | None, path: str) -> Any:
    """``state`` (the main process's) with this rank's own entry in param group 0."""
    main = checkpoint_position(state)
    if saved is None:
        if main is not None and main[1]:
            raise RuntimeError(
                f"{_WHERE} (load_state): saved in the middle of an accumulation window, but "
                f"{path} (this rank's window) is missing. Load save_state's folder whole, on as "
                "many processes, or a checkpoint saved at a boundary."
            )
        return state
    mine = checkpoint_position({"param_groups": [saved]})
    if mine is None or main is None or mine[0] != main[0]:
        raise RuntimeError(
            f"{_WHERE} (load_state): {path} is at (updates, micro-steps) {mine}, its "
            f"optimizer.bin at {main}; expected one save_state's folder, loaded whole."
        )
    groups = [dict(g) for g in state["param_groups"]]
    groups[0].update(saved)
    return {**state, "param_groups": groups}

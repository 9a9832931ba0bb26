"""Argument checks of accumopt's public entry points, run before any state changes (a refused call
loses nothing). Messages read ``<api>: <arg>=<value!r> <what is wrong>; expected <constraint>.
<what to do>``."""

from __future__ import annotations

import functools
import math
import numbers
import sys
import weakref
from typing import Any, TypeGuard

import torch

from accumopt import _grads

NONFINITE_POLICIES = (None, "skip_window")
_OWNERS: weakref.WeakKeyDictionary[object, weakref.ref[object]] = weakref.WeakKeyDictionary()
"""Inner optimizer -> the live wrapper around it (both held weakly)."""


def positive_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int >= 1 (a bool is not)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= 1


def _positive_real(value: object) -> TypeGuard[float]:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and float(value) > 0


def check_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """Return ``optimizer`` if it is a wrappable ``torch.optim.Optimizer``, else raise TypeError
    (an accumopt wrapper is refused: wrap the inner optimizer once)."""
    owner = _OWNERS.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    if owner is not None and owner() is not None:
        raise TypeError(
            "Accumulate: this optimizer is already wrapped by a live Accumulate; expected one "
            "wrapper per inner optimizer. Use the existing wrapper, or drop it (del) first."
        )
    if getattr(type(optimizer), "_accumopt_wrapper", False):
        raise TypeError(
            "Accumulate: optimizer is already an Accumulate; wrap the inner optimizer once instead."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "Accumulate: optimizer must be a torch.optim.Optimizer (not a model or a list), got "
            f"{type(optimizer).__qualname__}; expected e.g. torch.optim.AdamW(model.parameters())."
        )
    params = _grads.params_of(optimizer.param_groups)
    lazy = [i for i, p in enumerate(params) if isinstance(p, torch.nn.UninitializedParameter)]
    if lazy:
        raise TypeError(
            f"Accumulate: parameters {lazy} (counted over the param groups) are uninitialized lazy "
            "parameters; expected materialized ones. Run one forward pass before the optimizer."
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "Accumulate: LBFGS re-evaluates the loss in a closure that cannot span micro-batches; "
            "expected an optimizer whose step() needs none. For LBFGS, accumulate in its closure."
        )
    return optimizer


def claim(optimizer: torch.optim.Optimizer, wrapper: object) -> None:
    """Record that ``wrapper`` wraps ``optimizer`` (see :func:`check_optimizer`)."""
    _OWNERS[optimizer] = weakref.ref(wrapper)


def check_window(every: object, every_items: object) -> tuple[Any, Any]:
    """Validate the two window arguments; exactly one must be given: a size, or a schedule (a
    callable ``f(updates, items_seen) -> size``, validated by the window when it asks it)."""
    if (every is None) == (every_items is None):
        raise ValueError(
            f"Accumulate: got every={every!r} and every_items={every_items!r}; expected exactly "
            "one: every=N or every_items=T (backward passes or items per update), or a schedule."
        )
    if callable(every) or callable(every_items):
        return every, every_items
    if every is not None:
        if not positive_int(every):
            raise ValueError(
                f"Accumulate: every={every!r} is not a positive int; expected the number of "
                "backward passes per update (every=1: no accumulation)."
            )
        return int(every), None
    if not _positive_real(every_items):  # math.inf: a window only flush() closes
        raise ValueError(
            f"Accumulate: every_items={every_items!r} is not a positive finite number or "
            "math.inf; expected the number of items (samples or tokens) per update, e.g. "
            "every_items=4096 (math.inf: only opt.flush() applies the window)."
        )
    return None, float(every_items)


def check_reduction(reduction: object) -> str:
    """Validate ``reduction`` ("mean" or "sum")."""
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"Accumulate: reduction={reduction!r} is not supported; expected 'mean' or 'sum'."
        )
    return str(reduction)


def check_max_grad_norm(max_grad_norm: object) -> float | None:
    """Validate ``max_grad_norm`` (None, a positive number, or ``inf``: measure only)."""
    if max_grad_norm is not None and not _positive_real(max_grad_norm):  # NaN is not > 0
        raise ValueError(
            f"Accumulate: max_grad_norm={max_grad_norm!r} is not > 0; expected None, a norm or inf."
        )
    return None if max_grad_norm is None else float(max_grad_norm)


def check_scaler(scaler: object) -> torch.amp.GradScaler | None:
    """Validate ``scaler`` (None, or a ``torch.amp.GradScaler``)."""
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"Accumulate: scaler must be a torch.amp.GradScaler or None, got "
            f"{type(scaler).__qualname__}; pass the GradScaler your loop calls scaler.step() on."
        )
    return scaler


def check_buffer(buffer: object) -> bool | None:
    """Validate ``buffer`` (None, True or False)."""
    if buffer is not None and not isinstance(buffer, bool):
        raise ValueError(
            f"Accumulate: buffer={buffer!r} is not supported; expected None, True or False."
        )
    return buffer


def check_model(model: object, optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
    """Validate ``model``: None, or a ``torch.nn.Module`` with some of the optimizer's params."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"Accumulate: model is a {type(model).__qualname__}; expected the torch.nn.Module "
            "(plain, DDP or fully_shard-ed) whose outputs the losses are computed from, or None."
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "Accumulate: a TorchScript model cannot be hooked; expected an eager or compiled one."
        )
    wrapped = {id(p) for p in _grads.params_of(optimizer.param_groups)}
    if not any(id(p) in wrapped for p in model.parameters()):
        raise ValueError(
            f"Accumulate: the {type(model).__qualname__} given as model= holds none of the "
            "optimizer's parameters; expected the model whose parameters the optimizer updates."
        )
    return model


def check_nonfinite(nonfinite: object) -> str | None:
    """Validate ``nonfinite`` (one of :data:`NONFINITE_POLICIES`)."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"Accumulate: nonfinite={nonfinite!r} is not a policy; expected one of "
            f"{NONFINITE_POLICIES!r} ('raise', 'skip_micro_batch': gone in 0.2, see CHANGELOG.md)."
        )
    return nonfinite


def check_flag(value: object, name: str) -> bool:
    """A bool, else TypeError naming ``name`` (a string or a number is not taken as True)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"Accumulate: {name}={value!r} is a {type(value).__qualname__}; expected True or False."
        )
    return value


def check_loss(loss: object, api: str) -> None:
    """A one-element real tensor that requires grad, else TypeError/ValueError naming ``api``."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else None
        what = type(loss).__qualname__ if shape is None else f"tensor of shape {shape}"
        raise TypeError(
            f"{api}: loss is a {what}; expected a one-element tensor that requires grad (with "
            "items=, the micro-batch's summed loss). Reduce a tensor with .sum() or .mean()."
        )
    if loss.is_complex() or not loss.requires_grad:
        why = f"is complex ({loss.dtype})" if loss.is_complex() else "does not require grad"
        raise ValueError(
            f"{api}: the loss {why}; expected a real tensor that requires grad (not computed under "
            "torch.no_grad(), nor detached)."
        )


def check_items(items: object, api: str, read: bool = True) -> float | torch.Tensor:
    """Validate the item count given to ``Accumulate.<api>``. A tensor is read (one host sync)
    when ``read``, else kept as a detached 0-dim tensor checked when the window closes."""
    kind = type(items)
    if (kind is int or kind is float) and 0 <= items < math.inf:  # type: ignore[operator]
        return float(items)  # type: ignore[arg-type]
    what = f"Accumulate.{api}: items"
    if isinstance(items, torch.Tensor):
        check_count_tensor(items, what)
        if not read:  # summed in float64 (a low-precision or integer count sums inexactly)
            wide = torch.float32 if items.device.type == "mps" else torch.float64
            return items.detach().reshape(()).to(wide)
        items = items.item()
    return check_count(items, what, "the summed loss")


def check_count_tensor(count: torch.Tensor, what: str) -> None:
    """A one-element real tensor, else ValueError naming ``what``."""
    if count.numel() != 1 or count.is_complex():
        raise ValueError(
            f"{what} is a tensor of shape {tuple(count.shape)} and dtype {count.dtype}; "
            "expected a single real number (e.g. mask.sum())."
        )


def check_count(count: object, what: str, covers: str, where: str = "") -> float:
    """A finite number >= 0 (an item count), else ValueError naming ``what`` (and ``where``)."""
    if type(count) is int and count >= 0:  # the usual count: no abstract-class check
        return float(count)
    real = not isinstance(count, bool) and isinstance(count, numbers.Real)
    if not real or not 0 <= count < math.inf:  # type: ignore[operator]
        raise ValueError(
            f"{what}={count!r}{where} is not a finite number >= 0; expected the number of items "
            f"(samples or tokens) that {covers} covers."
        )
    return float(count)  # type: ignore[arg-type]


def check_fsdp(
    count_at: str, in_items: bool, every_step: bool, scaler: object, rollback: bool
) -> None:
    """Refuse what an FSDP2 model's sharded gradients cannot honour exactly."""
    for found, problem in [
        (count_at == "parameters", "count_at='parameters' (sharded: not in the graph)"),
        (in_items and not every_step, "every_items without reduce_every_micro_step=True"),
        (scaler is not None, "a GradScaler"),
        (rollback, "the rollback buffer (buffer=True)"),
    ]:
        if found:
            raise ValueError(
                f"Accumulate: an FSDP2 model with {problem} is not supported; expected every=N (or "
                "reduce_every_micro_step=True), counting at the outputs, no scaler, buffer=None."
            )


def framework_accumulating(closure: object = None) -> str | None:
    """The framework accumulating gradients around the wrapper (its loss division would shrink
    every update: refused), or None: a Lightning Trainer with ``accumulate_grad_batches > 1`` (in
    the closure it steps with), or Accelerate (the HF Trainer's) accumulating: gradient sync off,
    or ``gradient_accumulation_steps > 1`` (``accelerator.backward`` divides every loss by it)."""
    if getattr(lightning_trainer(closure), "accumulate_grad_batches", 1) != 1:
        return "a Lightning Trainer with accumulate_grad_batches > 1"
    accelerate = sys.modules.get("accelerate.state")
    shared = {} if accelerate is None else accelerate.GradientState._shared_state
    steps = (shared.get("plugin_kwargs") or {}).get("num_steps", 1)
    if shared.get("sync_gradients", True) is False or steps > 1:
        return "Accelerate (or the HF Trainer) with gradient_accumulation_steps > 1"
    return None


def lightning_trainer(closure: object) -> Any:
    """The Lightning ``Trainer`` whose closure ``closure`` is (its precision plugin's partial over
    the ``LightningModule``), or None."""
    if isinstance(closure, functools.partial) and closure.args:
        return getattr(closure.args[0], "_trainer", None)
    return None


LIGHTNING_WITHOUT_CALLBACK = (
    "Accumulate.step: a Lightning Trainer steps this wrapper without accumopt's "
    "AccumulateCallback, so global_step, max_steps and step schedulers count micro-batches and "
    "windows run across epochs. Add callbacks=[AccumulateCallback()] "
    "(accumopt.integrations.lightning); nothing was changed."
)


def refuse_framework(framework: str) -> str:
    """The refusal for :func:`framework_accumulating`'s answer."""
    return (
        f"Accumulate: {framework} accumulates gradients around the wrapper: each update is too "
        "small. Set its accumulation to 1 (every= sets the window), or use accumopt.integrations."
    )

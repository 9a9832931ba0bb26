"""Argument validation for accumopt's public entry points.

Every message follows one template: ``<api>: <arg>=<value!r> <what is wrong>; expected
<constraint>. <what to do>``. Validation always runs before any state changes, so a rejected call
loses nothing that was already accumulated.
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Any, TypeGuard

import torch

from accumopt import _grads


def positive_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int >= 1 (a bool is not)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= 1


def check_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """Return ``optimizer`` if it is a wrappable ``torch.optim.Optimizer``, else raise TypeError
    (an accumopt wrapper is refused: wrap the inner optimizer once)."""
    owner = _OWNERS.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    if owner is not None and owner() is not None:
        raise TypeError(
            "Accumulate: this optimizer is already wrapped by a live Accumulate; expected one "
            "wrapper per inner optimizer (two would count every backward pass twice and step "
            "the inner optimizer from both). Use the existing wrapper, or drop it (del) first."
        )
    if getattr(type(optimizer), "_accumopt_wrapper", False):
        raise TypeError(
            "Accumulate: optimizer is already an AccumulatingOptimizer; expected a plain "
            "torch.optim.Optimizer. Wrap the inner optimizer once and set every= on that wrapper."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Accumulate: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__qualname__}; expected e.g. torch.optim.AdamW(model.parameters()). "
            "Wrap the optimizer, not a model, a scheduler or a parameter list."
        )
    lazy = [
        i
        for i, p in enumerate(_grads.params_of(optimizer.param_groups))
        if isinstance(p, torch.nn.parameter.UninitializedParameter)
    ]
    if lazy:
        raise TypeError(
            f"Accumulate: parameters {lazy} (counted from 0 over the param groups) are "
            "uninitialized lazy parameters; expected materialized parameters. Run one forward "
            "pass (e.g. model(example_batch)) before building the optimizer and the wrapper."
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "Accumulate: LBFGS re-evaluates the loss through a closure several times per step, "
            "which cannot be spread over micro-batches; expected an optimizer whose step() needs "
            "no closure. For LBFGS over a large batch, accumulate inside its closure instead "
            "(backward each micro-batch's share of the loss there, then return the total)."
        )
    return optimizer


_OWNERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[object]] = (
    weakref.WeakKeyDictionary()
)
"""Inner optimizer -> the live wrapper around it (both held weakly)."""


def claim(optimizer: torch.optim.Optimizer, wrapper: object) -> None:
    """Record that ``wrapper`` wraps ``optimizer`` (see :func:`check_optimizer`)."""
    _OWNERS[optimizer] = weakref.ref(wrapper)


def check_window(every: object, every_items: object) -> tuple[Any, Any]:
    """Validate the two window arguments; exactly one must be given: a size, or a schedule (a
    callable ``f(updates, items_seen) -> size``, validated by the window when it asks it)."""
    if (every is None) == (every_items is None):
        raise ValueError(
            f"Accumulate: got every={every!r} and every_items={every_items!r}; expected exactly "
            "one of them: every=N (backward passes per update) or every_items=T (items, e.g. "
            "samples or tokens, per update), or a schedule of either (accumopt.schedules)."
        )
    if callable(every) or callable(every_items):
        return every, every_items
    if every is not None:
        if not positive_int(every):
            raise ValueError(
                f"Accumulate: every={every!r} is not a positive int; expected the number of "
                "backward passes (micro-steps) per update, >= 1 (every=1 means no accumulation)."
            )
        return int(every), None
    if (
        isinstance(every_items, bool)
        or not isinstance(every_items, numbers.Real)
        or not math.isfinite(float(every_items))
        or every_items <= 0
    ):
        raise ValueError(
            f"Accumulate: every_items={every_items!r} is not a positive finite number; expected "
            "the number of items (samples or tokens) per update, e.g. every_items=4096."
        )
    return None, float(every_items)


def check_reduction(reduction: object) -> str:
    """Validate ``reduction`` ("mean" or "sum")."""
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"Accumulate: reduction={reduction!r} is not supported; expected 'mean' (the update "
            "of the window's mean loss) or 'sum' (summed gradients, no division)."
        )
    return str(reduction)


def check_max_grad_norm(max_grad_norm: object) -> float | None:
    """Validate ``max_grad_norm`` (None, a positive number, or ``inf``: measure only)."""
    if max_grad_norm is None:
        return None
    if (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, numbers.Real)
        or math.isnan(float(max_grad_norm))
        or max_grad_norm <= 0
    ):
        raise ValueError(
            f"Accumulate: max_grad_norm={max_grad_norm!r} is not a positive number; expected "
            "None (no clipping), the largest total 2-norm of the window's gradient, or "
            "float('inf') (measure the norm, opt.last_window.grad_norm, without clipping)."
        )
    return float(max_grad_norm)


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
            f"Accumulate: buffer={buffer!r} is not supported; expected None (float32 window "
            "buffer for bf16/fp16 parameters only), True (every parameter) or False (none)."
        )
    return buffer


def check_model(model: object, optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
    """Validate ``model``: None, or a ``torch.nn.Module`` holding some of the optimizer's
    parameters."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"Accumulate: model is a {type(model).__qualname__}; expected the torch.nn.Module "
            "whose outputs the losses are computed from (plain, DistributedDataParallel or "
            "fully_shard-ed), or None."
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "Accumulate: model is a TorchScript module, which cannot carry the forward hook "
            "that counts at its outputs; expected an eager or torch.compile-d module, or no "
            "model= (counting at the parameters)."
        )
    wrapped = {id(p) for p in _grads.params_of(optimizer.param_groups)}
    if not any(id(p) in wrapped for p in model.parameters()):
        raise ValueError(
            f"Accumulate: the {type(model).__qualname__} given as model= holds none of the "
            "optimizer's parameters; expected the model whose parameters the optimizer "
            "updates (the one whose outputs the losses are computed from)."
        )
    return model


NONFINITE_POLICIES = (None, "skip_window", "skip_micro_batch", "raise")


def check_nonfinite(nonfinite: object) -> str | None:
    """Validate ``nonfinite`` (one of :data:`NONFINITE_POLICIES`)."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"Accumulate: nonfinite={nonfinite!r} is not a policy; expected one of "
            f"{NONFINITE_POLICIES!r}."
        )
    return nonfinite


def check_loss(loss: object) -> None:
    """Validate the loss handed to ``Accumulate.backward``."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (
            f"tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else (type(loss).__qualname__)
        )
        raise TypeError(
            f"Accumulate.backward: loss is a {what}; expected a one-element tensor that "
            "requires grad (the micro-batch's summed loss when items= is given)."
        )


def check_items(items: object) -> float | None:
    """Validate a micro-batch's item count; tensors are read once (one host sync)."""
    if items is None:
        return None
    if isinstance(items, torch.Tensor):
        check_count_tensor(items, "Accumulate.backward: items")
        items = items.item()
    return check_count(items, "Accumulate.backward: items", "the summed loss")


def check_count_tensor(count: torch.Tensor, what: str) -> None:
    """A one-element real tensor, else TypeError/ValueError naming ``what``."""
    if count.numel() != 1 or count.is_complex():
        raise ValueError(
            f"{what} is a tensor of shape {tuple(count.shape)} and dtype {count.dtype}; "
            "expected a single real number (e.g. mask.sum())."
        )


def check_count(count: object, what: str, covers: str, where: str = "") -> float:
    """A finite number >= 0 (an item count), else ValueError naming ``what`` (and ``where``)."""
    if type(count) is int and count >= 0:  # the usual count: no abstract-class check
        return float(count)
    if (
        isinstance(count, bool)
        or not isinstance(count, numbers.Real)
        or not math.isfinite(float(count))
        or count < 0
    ):
        raise ValueError(
            f"{what}={count!r}{where} is not a finite number >= 0; expected the number of items "
            f"(samples or tokens) that {covers} covers."
        )
    return float(count)


def check_policies(
    nonfinite: str | None, scaler: object, buffer: bool | None, distributed: bool
) -> None:
    """Refuse combinations of ``nonfinite`` with a scaler, DDP/FSDP2 or ``buffer=False``."""
    if nonfinite == "raise" and scaler is not None:
        raise ValueError(
            "Accumulate: nonfinite='raise' with a GradScaler would raise on every loss-scale "
            "overflow (the scaler backs off only when it sees the inf); expected "
            "nonfinite='skip_micro_batch' or 'skip_window' under AMP."
        )
    per_micro_batch = nonfinite in ("skip_micro_batch", "raise")
    if distributed and per_micro_batch:
        raise ValueError(
            f"Accumulate: nonfinite={nonfinite!r} with model= (torch.distributed) would let "
            "the ranks drop different micro-steps and disagree on the window; expected "
            "nonfinite='skip_window' or None under DDP/FSDP2."
        )
    if buffer is False and per_micro_batch:
        raise ValueError(
            f"Accumulate: nonfinite={nonfinite!r} drops single micro-batches, which needs the "
            "window buffer, but buffer=False; expected buffer=None or True."
        )

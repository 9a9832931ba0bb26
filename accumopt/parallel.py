"""Several devices in one process: :func:`parallel_backward` splits a batch, runs each piece's
forward pass on its device, gathers only the losses on the first device and runs ONE exactly
weighted backward pass (one micro-step of an ``Accumulate`` wrapper, or a plain backward)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.nn.parallel import parallel_apply, replicate

from accumopt import _checks, split
from accumopt.accumulate import Accumulate

LossOutput: TypeAlias = Tensor | tuple[Tensor, float | Tensor]
"""A piece's mean loss (a one-element tensor), or ``(loss_sum, items)``."""

LossFn: TypeAlias = Callable[[nn.Module, split.Batch], LossOutput]
"""``loss_fn(module, piece_batch)``: the forward pass and loss of one piece."""


def parallel_backward(
    model: nn.Module,
    loss_fn: LossFn,
    batch: split.Batch,
    devices: Sequence[split.DeviceLike],
    *,
    weights: Sequence[float] | None = None,
    opt: Accumulate | None = None,
) -> Tensor:
    """Forward ``batch`` split over ``devices``, then ONE backward of the exactly weighted loss.

    The batch is split by :func:`~accumopt.split.micro_split` (empty pieces are not run) and
    ``loss_fn(module, piece_batch)`` returns each piece's loss, which alone travels to
    ``devices[0]``: a one-element tensor is the piece's **mean** loss (``total = sum(loss_k *
    size_k)`` over ``n`` samples); ``(loss_sum, items)`` its **summed** loss over ``items``
    (a number or a one-element tensor; ``total = sum(loss_sum_k)`` over ``sum(items_k)``).
    Then ``opt.backward(total, items=total_items)`` (one micro-step) if ``opt`` is given, else
    ``(total / total_items).backward()`` (0 items: ``total`` undivided).

    One device listed several times runs the pieces in turn on ``model``; distinct CUDA devices
    run them concurrently on replicas, buffer updates dropped as in ``DataParallel`` (docs/guide/
    several-devices.md). BatchNorm normalises each piece alone.

    Returns:
        The mean loss over the call's samples (or items): a detached 0-dim tensor on
        ``devices[0]`` in the losses' dtype.

    Raises:
        TypeError: ``opt`` is not an ``Accumulate``; ``loss_fn`` returns neither a one-element
            tensor nor ``(tensor, items)``; ``micro_split``'s type errors.
        ValueError: devices that mix CPU and CUDA or repeat a CUDA device among others; a
            parameter or buffer not on ``devices[0]``; ``loss_fn`` returns both kinds, or items
            that are negative or not finite; ``micro_split``'s value errors.
        RuntimeError: gradients disabled (``torch.no_grad``); what ``opt.backward`` raises.

    Examples:
        >>> model = torch.nn.Linear(3, 1)
        >>> def loss_fn(m, b):
        ...     return torch.nn.functional.mse_loss(m(b["x"]), b["y"])
        >>> batch = {"x": torch.randn(5, 3), "y": torch.randn(5, 1)}
        >>> parallel_backward(model, loss_fn, batch, ["cpu", "cpu"]).shape
        torch.Size([])
    """
    if opt is not None and not isinstance(opt, Accumulate):
        raise TypeError(
            f"parallel_backward: opt is a {type(opt).__qualname__}; expected an Accumulate "
            "wrapper or None. Wrap the optimizer: opt=Accumulate(torch.optim.AdamW(...), every=k)."
        )
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "parallel_backward: gradients are disabled (torch.no_grad or inference mode); expected "
            "grad mode. Call it outside the no_grad block."
        )
    targets = split._check_devices(devices)
    replicated = _check_placement(model, targets)
    pieces = [p for p in split.micro_split(batch, devices, weights=weights) if p.size > 0]
    if replicated:
        replicas = dict(zip(targets, replicate(model, targets)))
        calls: Any = [functools.partial(loss_fn, replicas[p.device]) for p in pieces]  # no Module
        inputs = [(p.batch,) for p in pieces]
        outputs = parallel_apply(calls, inputs, devices=[p.device for p in pieces])
    else:
        outputs = [loss_fn(model, p.batch) for p in pieces]
    total, items = _combine(pieces, outputs, targets[0])
    mean = total / (torch.where(items > 0, items, 1.0) if isinstance(items, Tensor) else items or 1)
    if opt is not None:
        opt.backward(total, items=items)
    else:  # checked as Accumulate.backward checks them (a tensor count: one host read)
        _checks.check_loss(mean, "parallel_backward")
        if isinstance(items, Tensor):
            _checks.check_count(items.item(), "parallel_backward: items", "the summed loss")
        mean.backward()  # type: ignore[no-untyped-call]
    return mean.detach()


def _check_placement(model: nn.Module, targets: list[torch.device]) -> bool:
    """Whether the pieces run on replicas (distinct CUDA devices) rather than on ``model``."""
    primary = targets[0]
    sequential = all(d == primary for d in targets)
    distinct_cuda = len(set(targets)) == len(targets) and all(d.type == "cuda" for d in targets)
    if not (sequential or distinct_cuda):
        raise ValueError(
            f"parallel_backward: devices={[str(d) for d in targets]} mix devices; expected one "
            "device listed any number of times, or distinct CUDA devices. More pieces than GPUs: "
            "call it several times within an Accumulate window."
        )
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if t.device != primary:
            kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
            raise ValueError(
                f"parallel_backward: model {kind} {name!r} is on {t.device}; expected every "
                f"parameter and buffer on devices[0]={primary}. Call model.to('{primary}') first."
            )
    return not sequential


def _combine(
    pieces: list[split.Piece], outputs: Sequence[Any], primary: torch.device
) -> tuple[Tensor, float | Tensor]:
    """The summed loss on ``primary`` and the total item count, checking each output."""
    if len({isinstance(out, tuple) for out in outputs}) > 1:
        raise ValueError(
            "parallel_backward: loss_fn returned a scalar for some pieces and (loss_sum, items) "
            "for others; expected one kind for every piece. Return (loss_sum, items) throughout."
        )
    terms: list[Tensor] = []
    items: float | Tensor = 0.0
    for k, (piece, out) in enumerate(zip(pieces, outputs)):
        where = f"piece {k} on {piece.device}"
        if isinstance(out, tuple) and len(out) != 2:
            raise TypeError(
                f"parallel_backward: loss_fn returned a tuple of {len(out)} for {where}; "
                "expected (loss_sum, items) or a scalar mean loss."
            )
        loss, count = out if isinstance(out, tuple) else (out, piece.size)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            got = f"tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss)
            raise TypeError(
                f"parallel_backward: loss_fn returned a {got} for {where}; expected a scalar mean "
                "loss, or (loss_sum, items) with a one-element loss_sum. Reduce it over the piece."
            )
        terms.append(loss.to(primary).reshape(()) * (1 if isinstance(out, tuple) else piece.size))
        if not isinstance(count, Tensor):  # a finite number >= 0, else ValueError
            name, covers = "parallel_backward: items", "the piece's summed loss"
            items = items + _checks.check_count(count, name, covers, f" for {where}")
            continue
        try:  # a one-element real tensor, else TypeError
            _checks.check_count_tensor(count, f"parallel_backward: items for {where}")
        except ValueError as err:
            raise TypeError(str(err)) from None
        items = items + count.reshape(()).to(terms[-1].device, terms[-1].dtype)
    return sum(terms[1:], terms[0]), items

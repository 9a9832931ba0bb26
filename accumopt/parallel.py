"""Several devices in one process: ``parallel_backward(model, loss_fn, batch, devices)``.

One call splits the batch over the devices (:func:`accumopt.split.micro_split`), runs every
piece's forward pass, gathers only the per-piece losses on the first device, combines them with
exact weights and runs ONE backward pass: one micro-step of an ``Accumulate`` wrapper, or a
plain backward of the mean. The same model object serves one device or several.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.nn.parallel import parallel_apply, replicate

from accumopt import _checks, split
from accumopt.accumulate import AccumulatingOptimizer

LossOutput: TypeAlias = Tensor | tuple[Tensor, float | Tensor]
"""A piece's mean loss (scalar tensor), or ``(loss_sum, items)``."""

LossFn: TypeAlias = Callable[[nn.Module, split.Batch], LossOutput]
"""``loss_fn(module, piece_batch)``: the forward pass and loss of one piece."""


def parallel_backward(
    model: nn.Module,
    loss_fn: LossFn,
    batch: split.Batch,
    devices: Sequence[split.DeviceLike],
    *,
    weights: Sequence[float] | None = None,
    opt: AccumulatingOptimizer | None = None,
) -> Tensor:
    """Forward ``batch`` split over ``devices``, then ONE backward of the exactly weighted loss.

    The batch is split with :func:`~accumopt.split.micro_split` (one piece per device, moved
    straight to it). ``loss_fn(module, piece_batch)`` runs each piece's forward pass and loss;
    only the losses travel to ``devices[0]``, where they are combined:

    - ``loss_fn`` returns a scalar tensor, the piece's **mean** loss over its samples: the
      pieces are weighted by their sizes, ``total = sum(loss_k * size_k)`` over ``n`` samples;
    - ``loss_fn`` returns ``(loss_sum, items)``, the piece's **summed** loss and how many items
      (samples, or tokens that carry a loss; a number or a one-element tensor) it covers:
      ``total = sum(loss_sum_k)`` over ``sum(items_k)`` items.

    Then one backward pass: ``opt.backward(total, items=total_items)`` when an ``Accumulate``
    wrapper is given (one micro-step of its window: the window's update is the exact mean over
    all of its items, whatever the split), else ``(total / total_items).backward()``. Either
    way the gradient equals the full-batch gradient of the mean loss over the union of the
    pieces. A call whose pieces report 0 items in total backpropagates ``total`` undivided
    (normally zero) and returns it as the mean.

    **How the pieces run.** When every listed device is the same one (``["cpu", "cpu"]``,
    ``["cuda:0"]``), the pieces run one after the other on ``model`` itself, keeping every
    piece's graph until the backward (the memory of the whole batch; this path exists so that
    the semantics can be checked on any machine, and for one GPU). When the devices are
    distinct CUDA devices (CUDA only), the model is replicated with
    ``torch.nn.parallel.replicate`` (the replicas' gradients flow back to the original
    parameters through its autograd) and the pieces run concurrently with
    ``torch.nn.parallel.parallel_apply``, as in ``torch.nn.DataParallel`` but without scattering
    through the first GPU and gathering only the losses. Pieces of size 0 (possible with
    ``weights``) are not run.

    **Buffers** (BatchNorm running statistics). On the sequential path the model's buffers are
    updated once per piece. On the replicated path, buffer updates made on replicas other than
    the one on ``devices[0]`` are dropped (``DataParallel`` semantics); BatchNorm normalises
    each piece with its own statistics on both paths, so models with BatchNorm do not match
    the full batch exactly.

    Args:
        model: the module, with all its parameters and buffers on ``devices[0]``.
        loss_fn: ``loss_fn(module, piece_batch) -> loss | (loss_sum, items)``; it must call
            the ``module`` it is given (a replica on the piece's device), not ``model``. It
            returns the same kind of result for every piece.
        batch: tensor or dict/list/tuple/NamedTuple nesting, split along dim 0 (see
            :func:`~accumopt.split.micro_split`).
        devices: one entry per piece: all the same device, or distinct CUDA devices
            (``"cuda:0"``, ``torch.device``, int index); ``devices[0]`` holds the model.
        weights: optional relative shares of rows per device (unequal GPUs), as in
            :func:`~accumopt.split.micro_split`.
        opt: optional ``Accumulate`` wrapper over ``model``'s parameters; the backward pass is
            one of its micro-steps, weighted by the call's total items.

    Returns:
        The mean loss over the call's samples (or items): a detached 0-dim tensor on
        ``devices[0]`` with the losses' dtype.

    Raises:
        TypeError: ``opt`` is not an ``Accumulate`` wrapper; ``loss_fn`` returns neither a
            scalar tensor nor ``(tensor, items)``; and :func:`micro_split`'s type errors.
        ValueError: devices that mix CPU and CUDA or repeat a CUDA device among others; model
            parameters or buffers not on ``devices[0]``; ``loss_fn`` returns both kinds, or
            negative / non-finite ``items``; and :func:`micro_split`'s value errors.
        RuntimeError: called with gradients disabled (``torch.no_grad``); and whatever
            ``opt.backward`` raises (e.g. its window is complete and ``step()`` is due).

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> def loss_fn(m, b):
        ...     return torch.nn.functional.mse_loss(m(b["x"]), b["y"])
        >>> batch = {"x": torch.randn(5, 3), "y": torch.randn(5, 1)}
        >>> parallel_backward(model, loss_fn, batch, ["cpu", "cpu"]).shape
        torch.Size([])

    References:
        padertorch's trainer (the same model for one or several GPUs, one example per GPU,
        only the loss gathered); ``torch.nn.DataParallel`` (``replicate``, ``parallel_apply``).
    """
    if opt is not None and not isinstance(opt, AccumulatingOptimizer):
        raise TypeError(
            f"parallel_backward: opt is a {type(opt).__qualname__}; expected an Accumulate "
            "wrapper (or None for a plain backward). Wrap the optimizer: "
            "opt=Accumulate(torch.optim.AdamW(model.parameters()), every=k)."
        )
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "parallel_backward: gradients are disabled (torch.no_grad or inference mode); "
            "expected grad mode, since the call ends with a backward pass. Call it outside "
            "the no_grad block."
        )
    targets = split._check_devices(devices)
    replicated = _check_placement(model, targets)
    pieces = [p for p in split.micro_split(batch, devices, weights=weights) if p.size > 0]
    if replicated:
        replicas = replicate(model, targets)
        by_device = {d: r for d, r in zip(targets, replicas)}
        calls = [_LossCall(by_device[p.device], loss_fn) for p in pieces]
        outputs = parallel_apply(
            calls, [(p.batch,) for p in pieces], devices=[p.device for p in pieces]
        )
    else:
        outputs = [loss_fn(model, p.batch) for p in pieces]
    total, items = _combine(pieces, outputs, targets[0])
    denominator = _nonzero(items)
    if opt is not None:
        opt.backward(total, items=items)
    else:
        (total / denominator).backward()  # type: ignore[no-untyped-call]
    return (total / denominator).detach()


class _LossCall(nn.Module):
    """``loss_fn`` bound to one replica, in the module shape that ``parallel_apply`` calls."""

    def __init__(self, replica: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.replica = replica
        self.loss_fn = loss_fn

    def forward(self, piece_batch: split.Batch) -> LossOutput:
        return self.loss_fn(self.replica, piece_batch)


def _check_placement(model: nn.Module, targets: list[torch.device]) -> bool:
    """Whether the pieces run on replicas (distinct CUDA devices) rather than on ``model``."""
    primary = targets[0]
    sequential = all(d == primary for d in targets)
    distinct_cuda = len(set(targets)) == len(targets) and all(d.type == "cuda" for d in targets)
    if not (sequential or distinct_cuda):
        raise ValueError(
            f"parallel_backward: devices={[str(d) for d in targets]} mix devices; expected "
            "one device listed any number of times, or distinct CUDA devices. For more pieces "
            "than GPUs, call parallel_backward several times within an Accumulate window."
        )
    for kind, tensors in (
        ("parameter", model.named_parameters()),
        ("buffer", model.named_buffers()),
    ):
        for name, t in tensors:
            if t.device != primary:
                raise ValueError(
                    f"parallel_backward: model {kind} {name!r} is on {t.device}; expected every "
                    f"parameter and buffer on devices[0]={primary}. Call "
                    f"model.to({str(primary)!r}) first."
                )
    return not sequential


def _combine(
    pieces: list[split.Piece], outputs: Sequence[object], primary: torch.device
) -> tuple[Tensor, float | Tensor]:
    """The summed loss on ``primary`` and the total item count, checking each output."""
    kinds = {isinstance(out, tuple) for out in outputs}
    if len(kinds) > 1:
        raise ValueError(
            "parallel_backward: loss_fn returned a scalar for some pieces and (loss_sum, items) "
            "for others; expected the same kind for every piece. Return (loss_sum, items) "
            "throughout for item weighting."
        )
    total: Tensor | None = None
    items: float | Tensor = 0.0
    for k, (piece, out) in enumerate(zip(pieces, outputs)):
        where = f"piece {k} on {piece.device}"
        if isinstance(out, tuple):
            loss, count = _check_pair(out, where)
            term = loss.to(primary)
        else:
            loss, count = _check_loss(out, where, "a scalar tensor (the mean loss)"), piece.size
            term = loss.to(primary) * piece.size
        total = term if total is None else total + term
        items = items + (count.to(primary, term.dtype) if isinstance(count, Tensor) else count)
    assert total is not None  # micro_split returns at least one non-empty piece
    return total.reshape(()), items


def _check_loss(loss: object, where: str, expected: str) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss)
        raise TypeError(
            f"parallel_backward: loss_fn returned a {what} for {where}; expected {expected} "
            "or (loss_sum, items). Reduce the loss over the piece (mean, or sum with items)."
        )
    return loss


def _check_pair(out: tuple[Any, ...], where: str) -> tuple[Tensor, float | Tensor]:
    if len(out) != 2:
        raise TypeError(
            f"parallel_backward: loss_fn returned a tuple of {len(out)} for {where}; expected "
            "(loss_sum, items) or a scalar mean loss."
        )
    loss = _check_loss(out[0], where, "(loss_sum, items) with a one-element loss_sum")
    count = out[1]
    if isinstance(count, Tensor):
        try:
            _checks.check_count_tensor(count, f"parallel_backward: items for {where}")
        except ValueError as err:
            raise TypeError(str(err)) from None
        return loss, count.reshape(())
    covers = "the piece's summed loss"
    return loss, _checks.check_count(count, "parallel_backward: items", covers, f" for {where}")


def _nonzero(items: float | Tensor) -> float | Tensor:
    """``items``, or 1 where it is 0 (a call without items keeps its sum undivided)."""
    if isinstance(items, Tensor):
        return torch.where(items > 0, items, torch.ones_like(items))
    return items if items > 0 else 1.0

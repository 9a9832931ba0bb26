"""``@accumopt.apply``: a drop-in for mbp-pytorch's ``@mbp.apply``, with its defects fixed (a
short last micro-batch weighted by its rows, every sample processed, a ``GradScaler``, bad calls
refused, one call one micro-step of a wrapper): docs/guide/one-big-batch.md."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from accumopt import MicroStepGroup, _tree, split
from accumopt._checks import positive_int


def apply(
    batch_names: Sequence[str],
    ub_size: int = 1,
    device: str | int | torch.device = "cpu",
    device_ids: Sequence[int] | None = None,
    *,
    scaler: torch.amp.GradScaler | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a function that returns the *mean* loss of its batch (maybe followed by other
    outputs): each call runs the batch as micro-batches of at most ``ub_size`` rows, accumulates
    their gradients (one micro-step of an ``Accumulate`` wrapper) and returns the batch's mean
    loss (detached, 0-dim), or ``(loss, *others)``: tensor outputs concatenated along dim 0,
    others gathered in lists, as mbp-pytorch. The caller then steps once.

    Args:
        batch_names: the keyword arguments holding the batch (tensors, or nestings cut as by
            :func:`accumopt.split.micro_split`) sharing dim 0; they must be passed by keyword.
        ub_size: rows per micro-batch (int >= 1); the last one may be shorter.
        device: where each micro-batch is moved before the call (int: a CUDA index).
        device_ids: for signature compatibility with mbp-pytorch; only ``None``.
        scaler: a ``GradScaler`` that scales each weighted loss before its backward pass.

    Raises:
        ValueError: ``ub_size`` not a positive int; ``device_ids`` given; at call time, batch
            arguments that disagree on dim 0 or are empty.
        TypeError: at call time, a batch argument missing or passed positionally, or holding
            rows that cannot be cut; a function that does not return a scalar loss first.
    """
    if not positive_int(ub_size):
        raise ValueError(f"apply: ub_size={ub_size!r}; expected rows per micro-batch, an int >= 1.")
    if device_ids is not None:
        raise ValueError(
            f"apply: device_ids={list(device_ids)!r}; expected None. accumopt.apply processes "
            "every sample on `device`; for several GPUs use accumopt.parallel_backward (or DDP)."
        )
    target = split.parse_device(device, f"apply: device={device!r}")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            missing = [name for name in batch_names if name not in kwargs]
            if missing:
                expected = ", ".join(f"{n}=..." for n in batch_names)
                raise TypeError(
                    f"apply: batch argument(s) {missing} not passed by keyword to "
                    f"{func.__name__}; expected {func.__name__}(..., {expected})."
                )
            rows_of = _tree.RowSlicer({n: kwargs[n] for n in batch_names}, target, api="apply")
            n, group = rows_of.rows, MicroStepGroup()
            total: Tensor | None = None
            others: list[list[Any]] = []
            try:
                for piece, rows in rows_of.split(ub_size):
                    out = func(*args, **{**kwargs, **piece})
                    loss, *rest = out if isinstance(out, tuple) else (out,)
                    if not isinstance(loss, Tensor) or loss.numel() != 1:
                        raise TypeError(
                            f"apply: {func.__name__} returned {type(loss).__qualname__} first; "
                            "expected the micro-batch's mean loss as a scalar tensor."
                        )
                    weighted = loss * rows / n
                    with group:
                        scaled = weighted if scaler is None else scaler.scale(weighted)
                        torch.autograd.backward(scaled)
                    total = weighted.detach() if total is None else total + weighted.detach()
                    others.append(rest)
            except BaseException:
                group.fail()
                raise
            group.close()
            if not isinstance(out, tuple):  # the last micro-batch's: mbp's convention
                return total
            return (total, *(_gather(list(column)) for column in zip(*others)))

        return wrapper

    return decorate


def _gather(column: list[Any]) -> Any:
    if isinstance(column[0], Tensor) and column[0].dim() > 0:
        return _tree.concat(column, api="apply")
    return column if len(column) > 1 else column[0]

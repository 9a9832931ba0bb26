"""A drop-in for mbp-pytorch's ``@mbp.apply`` decorator, with its defects fixed.

``@accumopt.apply(["x", "label"], 16, device)`` on a function that returns the *mean* loss of
the batch it is given (optionally followed by other outputs) makes each call run the named
batch arguments as micro-batches of at most 16 rows and accumulate their gradients; the caller
then steps the optimizer once, as with mbp-pytorch. Differences from mbp-pytorch 0.2.6, each
covered by a test:

- each micro-batch's loss is weighted by its share of the rows, so a short last micro-batch is
  not over-weighted (mbp divides every chunk by the number of chunks: 18 % gradient error for
  40 samples at micro-batch 16);
- every sample is processed (mbp with ``device_ids=[0, 1]`` silently processed half of them);
  several devices are not handled here: see :func:`accumopt.parallel_backward`;
- a ``GradScaler`` can be passed (mbp calls ``backward`` itself on the raw loss);
- bad calls raise ``TypeError``/``ValueError`` with a message (mbp uses ``assert``);
- under an ``Accumulate`` wrapper one call is one micro-step (its micro-batches' backward
  passes are counted together when the call returns), not one per micro-batch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from accumopt import _tree
from accumopt._checks import positive_int


class _Call(threading.local):
    """The decorated call running on this thread (a nested call joins it): the ``Accumulate``
    wrappers its micro-batches' backward passes reached, or None outside a call."""

    group: list[Any] | None = None


class _InFlight:
    """The group of the call whose own backward pass runs now, or None. One per process, not
    per thread: autograd ends a CUDA pass on its device thread, where ``Accumulate`` reads it
    (``_intake``); set only while the call's ``backward()`` runs, so the passes another thread
    runs meanwhile, outside that call, are their own (unless they end during it)."""

    group: list[Any] | None = None


_CALL = _Call()
IN_FLIGHT = _InFlight()


def _run_as_one_micro_step(body: Callable[[], Any]) -> Any:
    """Run ``body`` (a decorated call): each wrapper its backward passes reached counts them as
    one micro-step when it returns; when anything raises before a wrapper was counted, that
    wrapper refuses until ``discard()`` (its ``.grad`` may hold part of the batch)."""
    if _CALL.group is not None:
        return body()
    group: list[Any] = []
    _CALL.group = group
    done = 0
    try:
        result = body()
        for opt in group:
            opt._commit_deferred_as(None)
            done += 1
    except BaseException:
        for opt in group[done:]:  # as after a backward pass that failed part-way
            opt._counter.pause("")
        raise
    finally:
        _CALL.group = None
    return result


def held_by_call(opt: object) -> bool:
    """Whether the call running on this thread holds a pass of ``opt`` not yet counted."""
    return any(held is opt for held in _CALL.group or ())


def _backward(loss: Tensor) -> None:
    """The call's backward pass of one micro-batch, its end read into the call's group."""
    IN_FLIGHT.group = _CALL.group
    try:
        loss.backward()  # type: ignore[no-untyped-call]
    finally:
        IN_FLIGHT.group = None


def apply(
    batch_names: Sequence[str],
    ub_size: int = 1,
    device: str | int | torch.device = "cpu",
    device_ids: Sequence[int] | None = None,
    *,
    scaler: torch.amp.GradScaler | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a loss function so that each call runs its batch as micro-batches.

    Args:
        batch_names: the keyword arguments that hold batch tensors (or nestings of tensors,
            per-sample lists, Mappings and dataclasses, cut as by
            :func:`accumopt.split.micro_split`) sharing dim 0; they must be passed by keyword.
        ub_size: rows per micro-batch (int >= 1); the last one may be shorter.
        device: where each micro-batch is moved before the call (int: a CUDA index).
        device_ids: accepted for signature compatibility with mbp-pytorch; only ``None``.
        scaler: a ``torch.amp.GradScaler``: each micro-batch's weighted loss is scaled
            before its backward; then call ``scaler.step(opt); scaler.update()`` as usual.

    With an ``accumopt.Accumulate`` wrapper over the parameters, each call is one micro-step
    (the backward passes of its micro-batches together, counted when it returns; when the call
    raises, the wrapper refuses until ``discard()``): call ``opt.step()`` after each call.

    Returns:
        A decorator. The decorated function returns the batch's mean loss (a detached 0-dim
        tensor) if the function returns a loss alone, else ``(loss, *others)`` with tensor
        outputs concatenated along dim 0 and other outputs gathered in lists, as mbp-pytorch.

    Raises:
        ValueError: ``ub_size`` not a positive int; ``device_ids`` given; at call time, the
            batch arguments disagree on dim 0 or are empty.
        TypeError: at call time, a batch argument is missing or passed positionally, holds
            no tensor or a tensor whose rows cannot be cut; the function does not return a
            scalar loss tensor first.
    """
    if not positive_int(ub_size):
        raise ValueError(f"apply: ub_size={ub_size!r}; expected rows per micro-batch, an int >= 1.")
    if device_ids is not None:
        raise ValueError(
            f"apply: device_ids={list(device_ids)!r}; expected None. accumopt.apply processes "
            "every sample on `device`; for several GPUs use accumopt.parallel_backward (or DDP)."
        )
    target = torch.device(f"cuda:{device}" if isinstance(device, int) else device)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return _run_as_one_micro_step(lambda: run(*args, **kwargs))

        def run(*args: Any, **kwargs: Any) -> Any:
            missing = [name for name in batch_names if name not in kwargs]
            if missing:
                raise TypeError(
                    f"apply: batch argument(s) {missing} not passed by keyword to "
                    f"{func.__name__}; expected {func.__name__}(..., "
                    + ", ".join(f"{n}=..." for n in batch_names)
                    + ")."
                )
            batch = {name: kwargs[name] for name in batch_names}
            rows_of = _tree.RowSlicer(batch, target, api="apply")
            n = rows_of.rows
            total: Tensor | None = None
            others: list[tuple[Any, ...]] = []
            single = True
            for start in range(0, n, ub_size):
                piece = rows_of(start, start + ub_size)
                out = func(*args, **{**kwargs, **piece})
                single = not isinstance(out, tuple)
                loss, rest = (out, ()) if single else (out[0], tuple(out[1:]))
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise TypeError(
                        f"apply: {func.__name__} returned {type(loss).__qualname__} first; "
                        "expected the micro-batch's mean loss as a scalar tensor."
                    )
                weighted = loss * (min(n, start + ub_size) - start) / n
                scaled = scaler.scale(weighted) if scaler is not None else weighted
                _backward(scaled)
                total = weighted.detach() if total is None else total + weighted.detach()
                others.append(rest)
            assert total is not None
            if single:
                return total
            return (total, *(_gather(list(column)) for column in zip(*others)))

        return wrapper

    return decorate


def _gather(column: list[Any]) -> Any:
    if isinstance(column[0], Tensor) and column[0].dim() > 0:
        return _tree.concat(column, api="apply")
    return column if len(column) > 1 else column[0]

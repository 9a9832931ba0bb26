"""What ``MicroBatchRunner``'s ``loss_fn`` returns, checked before the micro-batch's backward
pass: a result that cannot be counted is refused there, and the wrapper counts nothing for it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from accumopt import _kinds
from accumopt._checks import check_count, check_count_tensor
from accumopt._nesting import flatten
from accumopt._tree import row_shape

NOT_TRAINED = (
    "The micro-batches before this one were trained; this one and the rest of the batch were not."
)


def parse(result: Any, rows: int) -> tuple[Tensor, float, Any]:
    """Split ``loss_fn``'s result into (loss, items, outputs), refusing what cannot be counted."""
    if isinstance(result, tuple) and len(result) in (2, 3):
        loss, items = result[0], _count(result[1])
        out = result[2] if len(result) == 3 else None
    elif isinstance(result, Tensor):
        loss, items, out = result, float(rows), None
    else:
        raise TypeError(
            f"MicroBatchRunner: loss_fn returned a {type(result).__qualname__}; expected a loss "
            "tensor, (loss, items) or (loss, items, outputs). Return the micro-batch's loss "
            f"first. {NOT_TRAINED}"
        )
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"MicroBatchRunner: loss_fn returned loss={_brief(loss)}, a "
            f"{type(loss).__qualname__}; expected a one-element tensor that requires grad. "
            f"Return the loss tensor itself, not loss.item(). {NOT_TRAINED}"
        )
    if loss.numel() != 1 or not loss.requires_grad:
        wrong = (
            f"of shape {tuple(loss.shape)}"
            if loss.numel() != 1
            else "that does not require grad (computed under torch.no_grad() or detached)"
        )
        raise ValueError(
            f"MicroBatchRunner: loss_fn returned loss={_brief(loss)}, a tensor {wrong}; expected "
            "a one-element tensor that requires grad: the micro-batch's summed loss (its mean "
            "with loss_reduction='mean'). Reduce it with .sum() and keep autograd on. "
            + NOT_TRAINED
        )
    return loss, items, out


def check_outputs(out: Any, reference: dict[str, Any] | None) -> None:
    """With ``return_outputs=True``: refuse outputs that could not be joined with the others
    after the batch, before the micro-batch's backward pass: nested unlike the earlier ones
    (``reference``: :func:`refer` of them, None before the first), a tensor leaf with rows that
    cannot be concatenated along dim 0 (by its kind, or by its shape past dim 0 unlike the
    earlier ones', ragged sizes aside; or without the dim 0 that theirs have). Leaves that are
    0-dim in the first outputs are taken whole from them."""
    if out is None:
        return
    leaves = _leaves(out)
    if reference is not None and sorted(leaves) != sorted(reference):
        raise ValueError(
            "MicroBatchRunner: loss_fn returned outputs nested differently from the first "
            "micro-batch's (other keys or leaves); expected one structure for every "
            f"micro-batch with return_outputs=True. {NOT_TRAINED}"
        )
    for path, leaf in leaves.items():
        was = leaf if reference is None else reference[path]
        if not (isinstance(was, Tensor) and was.dim() > 0):
            continue
        joinable = isinstance(leaf, Tensor) and leaf.dim() > 0
        if joinable and not (_legacy_empty(leaf) or _legacy_empty(was)):
            joinable = row_shape(leaf) == row_shape(was)
        if not joinable:
            what = f"of shape {tuple(leaf.shape)}" if isinstance(leaf, Tensor) else "no tensor"
            raise ValueError(
                f"MicroBatchRunner: loss_fn returned outputs with {path} {what}, "
                f"which cannot be concatenated along dim 0 with the earlier micro-batches' "
                f"{tuple(was.shape)}; expected the same shape past dim 0 in every micro-batch "
                f"(pad to one width, or return PerSample(list(...))). {NOT_TRAINED}"
            )
        try:
            _kinds.check(path, leaf, "MicroBatchRunner")
        except TypeError as err:
            raise TypeError(f"{err} (return_outputs=True) {NOT_TRAINED}") from None


def refer(reference: dict[str, Any] | None, out: Any) -> dict[str, Any]:
    """The leaves that later outputs must join, by path, once ``out`` (checked) joined
    ``reference``: each path's first leaf that is not ``torch.empty(0)``."""
    leaves = _leaves(out)
    if reference is None:
        return leaves
    return {
        path: leaves[path] if isinstance(was, Tensor) and _legacy_empty(was) else was
        for path, was in reference.items()
    }


def _leaves(out: Any) -> dict[str, Any]:
    return dict(flatten(out, "MicroBatchRunner", root="outputs")[0])


def _legacy_empty(t: Tensor) -> bool:
    """``torch.empty(0)``: ``torch.cat`` leaves it out whatever the others' shapes."""
    return t.dim() == 1 and t.numel() == 0 and t.layout == torch.strided and not t.is_nested


def summed(loss: Tensor, items: float, params: Iterable[Tensor]) -> Tensor:
    """The summed loss of a micro-batch whose ``loss_fn`` returned the mean over its ``items``
    (``loss_reduction="mean"``): ``loss * items``. A mean over no item is 0/0, whose gradient
    is NaN, while its sum is 0: then an exact zero is backpropagated through ``params``
    instead (each of their gradients written, as 0: give ``params`` where a DDP/FSDP2 reducer
    waits for every gradient) or, with no ``params``, through a fresh leaf (no gradient is
    written: a parameter no micro-batch reaches keeps ``.grad`` None, which optimizers such as
    AdamW skip while they move one whose gradient is 0)."""
    if items == 0:
        leaf = loss.new_zeros((), requires_grad=True)
        return sum((p.sum() for p in params if p.requires_grad), leaf) * 0.0
    return loss * items


def _count(items: object) -> float:
    """``loss_fn``'s item count as a float, or ValueError (read once: one host sync)."""
    what, covers = "MicroBatchRunner: loss_fn returned items", "the micro-batch's loss"
    try:
        if not isinstance(items, Tensor):
            return check_count(items, what, covers, ", which")
        check_count_tensor(items, f"{what}={_brief(items)}, which")
        return check_count(items.item(), what, covers, f" (read from {_brief(items)}), which")
    except ValueError as err:
        raise ValueError(
            f"{err} Return (loss, items) with items a Python number or a one-element tensor "
            f"(e.g. mask.sum()). {NOT_TRAINED}"
        ) from None


def _brief(value: object) -> str:
    """``repr(value)`` for an error message: a large tensor by its shape, long text cut."""
    if isinstance(value, Tensor) and value.numel() > 4:
        return f"<{value.dtype} tensor of shape {tuple(value.shape)}>"
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."

"""The sum of squares of many gradients, ``sum |g|²`` over a list, cheaply and without a host sync.

torch has no fused "squared norm of a tensor list". On CUDA ``torch._foreach_norm`` is one
fused kernel per device and dtype, but on a CPU it runs one norm per tensor (about 1.5 us
each, 150 us for a model of 100 small tensors). :class:`SquaredNorm` therefore stacks small CPU
gradients, one ``torch.stack`` per distinct shape (same-shaped tensors stack without a view per
tensor), and dots each stack with itself: every element's square is summed directly, with no
Python per tensor. The grouping is planned once per gradient count (one pass over the shapes)
and planned again when it no longer fits. Large gradients, CUDA, sparse gradients and several
devices take the norms instead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import Tensor

# CPU gradients of at most this many elements (4 MiB in float32), and at most _STACK_PER_TENSOR
# per tensor on average, are stacked: the copy then costs less than torch's norm per tensor
_STACK_ELEMENTS = 2**20
_STACK_PER_TENSOR = 2**14
_WIDE = (torch.float32, torch.float64)

Pick = Callable[[list[Tensor]], tuple[Tensor, ...] | list[Tensor]]  # the gradients of a shape


class SquaredNorm:
    """``sum |g|²`` over a list of gradients, as a 0-dim tensor (callable); keeps the plan of
    how to stack one model's gradients, so use one instance per model.

    Call with ``grads`` (a non-empty list of gradient tensors: any shapes, dtypes, devices,
    dense or sparse) and ``loss_scale`` (the AMP loss scale as a 0-dim tensor, or None).
    Returns the sum of squares divided by ``loss_scale²``: float64 when a gradient is float64,
    else float32 (bf16/fp16 are widened), on the first gradient's device; no host sync.
    Complex gradients raise RuntimeError (``torch._foreach_norm``).

    Small dense CPU gradients (at most 2**20 elements, 2**14 per tensor on average): one
    ``torch.stack`` per distinct shape and one ``dot`` per stack (the squares summed in the
    stack's dtype). Otherwise: ``torch._foreach_norm`` (fused on CUDA), the stacked norms dotted
    with themselves (a norm squared is within 2 ulps of the sum of squares).
    """

    def __init__(self) -> None:
        # gradient count -> the stacks (a picker of same-shaped gradients each), or None
        # when those gradients take the norms
        self._plans: dict[int, list[Pick] | None] = {}

    def __call__(self, grads: list[Tensor], loss_scale: Tensor | None = None) -> Tensor:
        sq = self._stacked(grads) if grads[0].is_cpu else None
        if sq is None:
            norms = _norms(grads)
            sq = torch.dot(norms, norms)
        if loss_scale is not None:
            sq = sq / loss_scale.to(device=sq.device, dtype=sq.dtype).square()
        return sq

    def _stacked(self, grads: list[Tensor]) -> Tensor | None:
        """The sum of squares by stacks, or None when ``grads`` take the norms."""
        if len(grads) not in self._plans:
            self._plans[len(grads)] = _plan(grads)
        plan = self._plans[len(grads)]
        if plan is None:
            return None
        try:
            stacks = [torch.stack(pick(grads)).view(-1) for pick in plan]
        except RuntimeError:  # a gradient changed shape, layout or device: plan again
            del self._plans[len(grads)]
            return None
        if sum(s.numel() for s in stacks) > _STACK_ELEMENTS:  # shapes grew: plan again
            del self._plans[len(grads)]
        squares = []
        for s in stacks:
            if s.dtype not in _WIDE:
                if not s.dtype.is_floating_point:  # complex: the norms raise
                    return None
                s = s.float()  # bf16/fp16: summed in float32
            squares.append(torch.dot(s, s))
        if len(squares) > 3:
            return torch.stack(squares).sum()
        return sum(squares[1:], squares[0])  # a few groups: adding beats stacking


def _plan(grads: list[Tensor]) -> list[Pick] | None:
    """One picker per distinct gradient shape (indices in list order), or None when the
    gradients are too large, sparse or on several devices."""
    total = sum(map(Tensor.numel, grads))
    if total > min(_STACK_ELEMENTS, _STACK_PER_TENSOR * len(grads)):
        return None
    if len({g.device for g in grads}) > 1 or any(g.layout != torch.strided for g in grads):
        return None
    shapes: dict[tuple[int, ...], list[int]] = {}
    for i, g in enumerate(grads):
        shapes.setdefault(tuple(g.shape), []).append(i)
    # itemgetter of one index returns the item itself: a one-item slice returns a list
    return [
        operator.itemgetter(*index if len(index) > 1 else [slice(index[0], index[0] + 1)])
        for index in shapes.values()
    ]


def _norms(grads: list[Tensor]) -> Tensor:
    """The 2-norms of ``grads`` stacked into one 1-D tensor: float64 when a gradient is
    float64, else float32 (sparse: of its coalesced values)."""
    wide = grads[0].dtype == torch.float64
    dtype = torch.float64 if wide else torch.float32
    try:  # the common case: one device, one dtype, dense: one foreach call, one stack
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=None if wide else dtype))
        if norms.dtype == dtype:
            return norms
    except RuntimeError:
        pass
    wide_grads = [g for g in grads if g.dtype == torch.float64 and not g.is_sparse]
    rest = [g for g in grads if g.dtype != torch.float64 and not g.is_sparse]
    parts: list[Tensor] = []
    if wide_grads:
        parts += torch._foreach_norm(wide_grads, 2)
    if rest:
        parts += torch._foreach_norm(rest, 2, dtype=torch.float32)
    parts += [torch.linalg.vector_norm(g.coalesce().values()) for g in grads if g.is_sparse]
    if len({(n.device, n.dtype) for n in parts}) > 1:
        dtype = torch.float64 if wide_grads else torch.float32
        parts = [n.to(device=parts[0].device, dtype=dtype) for n in parts]
    return torch.stack(parts)

"""Tensor kinds along the batch dimension: cut rows ``i:j`` of, and concatenate, dense,
sparse (COO, CSR, batched compressed), nested (jagged, strided) and quantized tensors and tensor
subclasses; refuse the kinds whose rows cannot be cut, naming the leaf and what to do."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from accumopt._nesting import short
from accumopt.oom import is_oom

_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_DENSE_HINT = "Convert it with .to_dense(), or wrap it in accumopt.split.Broadcast(...)."


def describe(t: Tensor) -> str:
    """``'tensor'`` for a plain dense tensor, else a short description of what it is."""
    if t.is_nested:
        return f"nested tensor ({'jagged' if t.layout == torch.jagged else 'strided'} layout)"
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')} tensor"
    if t.is_quantized:
        return f"quantized tensor ({str(t.qscheme()).removeprefix('torch.')})"
    if type(t) is not Tensor:
        return f"tensor subclass {type(t).__qualname__}"
    return "tensor"


def _compressed_indices(t: Tensor) -> tuple[Tensor, Tensor]:
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def _refusal(t: Tensor) -> str | None:
    """What to do with a tensor whose rows accumopt cannot cut (None: it can)."""
    if t.layout in _COMPRESSED and t.layout != torch.sparse_csr:
        if _compressed_indices(t)[0].dim() == 1:  # no batch dimension: dim 0 is compressed
            return "Convert it with .to_sparse_csr() or .to_sparse_coo(), or .to_dense()."
    elif t.layout not in (torch.strided, torch.sparse_coo, torch.jagged, torch.sparse_csr):
        return _DENSE_HINT
    return None


def _remedy(t: Tensor) -> str:
    if t.is_quantized:
        return "Dequantize it with .dequantize() first."
    if t.is_nested:
        return "Convert it with .to_padded_tensor(0.0), or pass PerSample(list(t.unbind()))."
    if type(t) is not Tensor and t.layout == torch.strided:
        return "Pass it as t.as_subclass(torch.Tensor), or wrap it in accumopt.split.Broadcast."
    return _DENSE_HINT


def cut(t: Tensor, start: int, stop: int) -> Tensor:
    """Rows ``start:stop`` (dim 0) of a tensor of any kind that :func:`check` accepts."""
    if t.is_nested:
        if t.layout == torch.jagged:
            return _cut_jagged(t, start, stop)
        if start == stop:  # torch's narrow fails or keeps one component here
            return torch.nested.nested_tensor([], dtype=t.dtype, device=t.device)
        return t.narrow(0, start, stop - start).contiguous()  # .to() needs it contiguous
    if t.is_quantized and start == stop and t.qscheme() != torch.per_tensor_affine:
        return _no_quantized_rows(t)
    if t.layout == torch.sparse_coo:
        return t.narrow_copy(0, start, stop - start)
    if t.layout in _COMPRESSED:
        return _cut_compressed(t, start, stop)
    return t[start:stop]


def _no_quantized_rows(t: Tensor) -> Tensor:
    """0 rows of a per-channel quantized tensor (torch's empty slice of one fails)."""
    if t.q_per_channel_axis() != 0:
        return t[:0]
    scales, zero_points = t.q_per_channel_scales()[:0], t.q_per_channel_zero_points()[:0]
    return torch.quantize_per_channel(t.dequantize()[:0], scales, zero_points, 0, t.dtype)


def join(parts: Sequence[Tensor]) -> Tensor:
    """Concatenate same-kind tensors along dim 0; the inverse of :func:`cut`."""
    first = parts[0]
    if first.is_nested and first.layout == torch.jagged:
        return _join_jagged(parts)
    if first.layout in _COMPRESSED:
        return _join_compressed(parts)
    if first.is_nested:  # an empty nested tensor has no trailing dimensions: leave it out
        return torch.cat([p.contiguous() for p in parts if p.size(0) > 0] or [first])
    return torch.cat(list(parts))


class _Jagged:
    """A jagged nested tensor's parts: ``values`` holds the components one after the other
    along ``dim``; component ``k`` starts at ``offsets[k]`` and, with holes, is ``lengths[k]``
    long (else it ends where the next starts)."""

    def __init__(self, t: Tensor) -> None:
        nt: Any = t  # NestedTensor's accessors are not in the Tensor stubs
        self.values: Tensor = nt.values()
        self.offsets: Tensor = nt.offsets()
        self.lengths: Tensor | None = nt.lengths()
        self.dim = int(nt._ragged_idx) - 1

    def lengths_or_gaps(self) -> Tensor:
        return self.offsets.diff() if self.lengths is None else self.lengths


def _cut_jagged(t: Tensor, start: int, stop: int) -> Tensor:
    j = _Jagged(t)
    low, high = int(j.offsets[start]), int(j.offsets[stop])
    return torch.nested.nested_tensor_from_jagged(
        j.values.narrow(j.dim, low, high - low),
        j.offsets[start : stop + 1] - low,
        lengths=None if j.lengths is None else j.lengths[start:stop],
        jagged_dim=j.dim + 1,
    )


def _join_jagged(parts: Sequence[Tensor]) -> Tensor:
    js = [_Jagged(p) for p in parts]
    dim = js[0].dim
    extents = [j.values.size(dim) for j in js]
    shifts = itertools.accumulate(extents[:-1], initial=0)
    offsets = [j.offsets[:-1] + shift for j, shift in zip(js, shifts)]
    offsets.append(js[0].offsets.new_tensor([sum(extents)]))
    holes = any(j.lengths is not None for j in js)
    return torch.nested.nested_tensor_from_jagged(
        torch.cat([j.values for j in js], dim),
        torch.cat(offsets),
        lengths=torch.cat([j.lengths_or_gaps() for j in js]) if holes else None,
        jagged_dim=dim + 1,
    )


def _cut_compressed(t: Tensor, start: int, stop: int) -> Tensor:
    compressed, plain = _compressed_indices(t)
    values = t.values()
    if compressed.dim() > 1:  # a batch dimension: dim 0 of every component
        parts = compressed[start:stop], plain[start:stop], values[start:stop]
    else:  # 2-D CSR: rows start:stop hold entries low:high
        low, high = int(compressed[start]), int(compressed[stop])
        parts = compressed[start : stop + 1] - low, plain[low:high], values[low:high]
    size = (stop - start, *t.shape[1:])
    return torch.sparse_compressed_tensor(*parts, size=size, layout=t.layout)


def _join_compressed(parts: Sequence[Tensor]) -> Tensor:
    indices = [_compressed_indices(p) for p in parts]
    plain = torch.cat([p for _, p in indices])
    values = torch.cat([p.values() for p in parts])
    if indices[0][0].dim() > 1:
        compressed = torch.cat([c for c, _ in indices])
    else:
        shifts = itertools.accumulate((int(c[-1]) for c, _ in indices), initial=0)
        starts = [c[:-1] + shift for (c, _), shift in zip(indices, shifts)]
        compressed = torch.cat([*starts, indices[0][0].new_tensor([values.size(0)])])
    size = (sum(p.size(0) for p in parts), *parts[0].shape[1:])
    return torch.sparse_compressed_tensor(
        compressed, plain, values, size=size, layout=parts[0].layout
    )


def guard(api: str, path: str, t: Tensor, doing: str, op: Callable[[], Tensor]) -> Tensor:
    """``op()``; torch's error for a tensor of a special kind becomes a message that says what
    the leaf is and what to do (out-of-memory errors and plain tensors' errors pass through)."""
    try:
        return op()
    except Exception as err:
        kind = describe(t)
        if kind == "tensor" or is_oom(err):
            raise
        text = (str(err).strip().splitlines() or [""])[0]
        raise TypeError(
            f"{api}: {path} is a {kind} that torch could not {doing} ({type(err).__name__}: "
            f"{text}); expected a tensor kind that supports it. {_remedy(t)}"
        ) from err


def check(path: str, t: Tensor, api: str) -> None:
    """Refuse a tensor leaf without rows or of a kind whose rows cannot be cut.

    Raises:
        ValueError: ``t`` is 0-dim.
        TypeError: ``t`` is a 2-D sparse CSC/BSR/BSC, MKL-DNN or other-layout tensor.
        Messages start with ``api`` and name the leaf by ``path``.
    """
    if t.dim() == 0:
        value = f"tensor({t.item()!r})" if t.layout == torch.strided else short(t)
        raise ValueError(
            f"{api}: {path}={value} is a 0-dim tensor; expected tensor leaves with a batch "
            "dimension (dim 0). Pass a per-batch scalar as a Python number, or give it a "
            "leading dimension of the batch length."
        )
    refusal = _refusal(t)
    if refusal is not None:
        raise TypeError(
            f"{api}: {path} is a {describe(t)}, whose rows (dim 0) accumopt cannot cut; expected "
            "a dense, sparse COO, sparse CSR, batched sparse compressed, nested or quantized "
            f"tensor. {refusal}"
        )

"""Nested batches: the rows of a dict/list/tuple/NamedTuple nesting of tensors.

A *batch* is a tensor or any nesting that ``torch.utils._pytree`` flattens; its tensor leaves
share the leading (batch) dimension, and its other leaves (strings, numbers, None...) are
passed through unchanged to every piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

Batch: TypeAlias = Any
"""A tensor, or a dict/list/tuple/NamedTuple nesting whose tensor leaves share dim 0."""


def leaf_paths(batch: Batch) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs, paths written as in Python (``batch['x']``, ``batch[1][0]``)."""
    flat, _ = pytree.tree_flatten_with_path(batch)
    return [("batch" + pytree.keystr(path), leaf) for path, leaf in flat]


def batch_size(batch: Batch, api: str) -> int:
    """The shared, non-zero leading dimension of the tensor leaves.

    Raises:
        TypeError: the batch holds no tensor.
        ValueError: a 0-dim tensor leaf, leaves that disagree on dim 0, or 0 rows; the
            message starts with ``api`` and names the offending leaf.
    """
    leaves = leaf_paths(batch)
    tensors = [(path, leaf) for path, leaf in leaves if isinstance(leaf, Tensor)]
    if not tensors:
        kinds = sorted({type(leaf).__qualname__ for _, leaf in leaves}) or ["nothing"]
        raise TypeError(
            f"{api}: batch has no tensor leaf (leaves: {', '.join(kinds)}); expected a "
            "tensor or a dict/list/tuple/NamedTuple nesting with at least one tensor. Convert "
            "arrays with torch.as_tensor first."
        )
    for path, leaf in tensors:
        if leaf.dim() == 0:
            raise ValueError(
                f"{api}: {path}=tensor({leaf.item()!r}) is a 0-dim tensor; expected "
                "tensor leaves with a batch dimension (dim 0). Pass a per-batch scalar as a "
                "Python number, or give it a leading dimension of the batch length."
            )
    first_path, first = tensors[0]
    n = int(first.shape[0])
    for path, leaf in tensors[1:]:
        if leaf.shape[0] != n:
            raise ValueError(
                f"{api}: {path} has {leaf.shape[0]} rows along dim 0 (shape "
                f"{tuple(leaf.shape)}) but {first_path} has {n}; expected every tensor leaf to "
                "share the batch length. Pass per-batch constants as non-tensor leaves."
            )
    if n == 0:
        raise ValueError(
            f"{api}: {first_path} has 0 rows; expected a non-empty batch. Skip empty batches."
        )
    return n


class RowSlicer:
    """Rows of one batch, moved to a device, many times: the batch is flattened once.

    ``RowSlicer(batch, device)(start, stop)`` is the batch with every tensor leaf cut to rows
    ``start:stop`` (views) and moved to ``device`` (None: left where it is) with :func:`move`,
    so the full batch can stay in host memory.
    """

    def __init__(self, batch: Batch, device: torch.device | None) -> None:
        self.leaves, self.spec = pytree.tree_flatten(batch)
        self.device = device

    def __call__(self, start: int, stop: int) -> Batch:
        device = self.device
        rows = [
            (leaf[start:stop] if device is None else move(leaf[start:stop], device))
            if isinstance(leaf, Tensor)
            else leaf
            for leaf in self.leaves
        ]
        return pytree.tree_unflatten(rows, self.spec)


def move(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor.to(device, non_blocking=True)``; a host tensor bound for CUDA is pinned first."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def concat(pieces: Sequence[Batch]) -> Batch:
    """Concatenate same-structured batches leaf by leaf along dim 0 (non-tensors: the first)."""
    flats = [pytree.tree_flatten(p) for p in pieces]
    spec = flats[0][1]
    columns = zip(*(leaves for leaves, _ in flats))
    merged = [
        torch.cat(list(col)) if isinstance(col[0], Tensor) and col[0].dim() > 0 else col[0]
        for col in columns
    ]
    return pytree.tree_unflatten(merged, spec)

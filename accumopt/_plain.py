"""The usual batch, taken apart and rebuilt cheaply: a runner cuts one batch into many
micro-batches, so what it does per batch and per piece is paid many times.

:func:`plain` takes apart a plain dense tensor, or a tuple, list or dict of them, without
``torch.utils._pytree`` (the same leaves and paths as :func:`accumopt._nesting.flatten`);
:func:`builder` turns a pytree spec of tuples, lists and dicts into a function that rebuilds
the nesting from its leaves faster than ``pytree.tree_unflatten``. Both decline (None) what
they do not cover, which then takes the general path of :mod:`accumopt._tree`.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

Rebuild = Callable[[Any], Any]
"""Rebuilds a batch from its leaves' values, in flattening order (a list or tuple)."""


def dense(t: Tensor) -> bool:
    """A plain dense tensor (cut by slicing): not a subclass, sparse, nested or quantized."""
    return type(t) is Tensor and t.layout == torch.strided and not (t.is_nested or t.is_quantized)


def plain(batch: Any) -> tuple[int, list[tuple[str, Tensor]], Rebuild] | None:
    """``(rows, [(path, leaf), ...], rebuild)`` of a plain dense tensor, or of a ``tuple``,
    ``list`` or ``dict`` (exactly those types) of plain dense tensors that agree on a
    non-zero dim 0; None for any other batch (which the caller flattens in full and refuses,
    if it must, with the general messages). Paths are written as ``flatten`` writes them
    (``batch``, ``batch[0]``, ``batch['x']``); dict leaves come in insertion order."""
    kind = type(batch)
    build: Rebuild
    if kind is Tensor:
        leaves = [("batch", batch)]
        build = operator.itemgetter(0)
    elif kind is tuple or kind is list:
        leaves = [(f"batch[{i}]", leaf) for i, leaf in enumerate(batch)]
        build = kind
    elif kind is dict:
        leaves = [(f"batch[{key!r}]", leaf) for key, leaf in batch.items()]
        keys = list(batch)

        def build(values: Any) -> dict[Any, Any]:
            return dict(zip(keys, values))

    else:
        return None
    if not leaves or not all(dense(t) and t.dim() > 0 for _, t in leaves):
        return None
    rows = leaves[0][1].size(0)
    if rows == 0 or any(t.size(0) != rows for _, t in leaves):
        return None
    return rows, leaves, build


def builder(spec: pytree.TreeSpec, index: Iterator[int] | None = None) -> Rebuild | None:
    """A fast ``tree_unflatten`` for a spec made of tuples, lists and dicts only (the usual
    batch), built once per batch: cutting a batch into many micro-batches rebuilds it many
    times. None for any other spec (``pytree.tree_unflatten`` is then used)."""
    index = itertools.count() if index is None else index
    if spec.is_leaf():
        return operator.itemgetter(next(index))
    # torch >= 2.13 has children(); 2.11-2.12 the children_specs list
    specs = spec.children() if hasattr(spec, "children") else spec.children_specs
    children = [builder(child, index) for child in specs]
    if any(c is None for c in children):
        return None
    kids: list[Rebuild] = children  # type: ignore[assignment]
    if spec.type is tuple:
        return lambda leaves: tuple([c(leaves) for c in kids])
    if spec.type is list:
        return lambda leaves: [c(leaves) for c in kids]
    if spec.type is dict:
        keys = list(spec.context)
        return lambda leaves: {k: c(leaves) for k, c in zip(keys, kids)}
    return None

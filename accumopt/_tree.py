"""Nested batches: count their rows, cut rows ``i:j`` out of them, and join pieces back.

A *batch* is a tensor or a nesting of containers; its rows are indexed by dim 0 of its tensor
leaves. :func:`batch_size`, :class:`RowSlicer` (used by ``MicroBatchRunner`` and
``accumopt.apply``), :func:`accumopt.split.micro_split` and :func:`concat` (outputs) all follow
these rules:

**Containers.** dict, list, tuple, NamedTuple, OrderedDict, defaultdict and any type registered
with ``torch.utils._pytree`` are walked by pytree. Two kinds pytree does not know are walked
too, and every piece holds a container of the same class: ``collections.abc.Mapping``
subclasses (``collections.UserDict``, Hugging Face's ``BatchEncoding``...), rebuilt as
``type(obj)(dict_of_items)`` (other attributes of the object are not carried over), and
dataclass instances, rebuilt with ``dataclasses.replace(obj, **fields)`` (only ``init=True``
fields are walked; ``__post_init__`` recomputes the others). Nothing is registered with pytree
for these types. A container that cannot be rebuilt this way is refused with ``TypeError``.

**Tensor leaves** all have the batch's ``n`` rows along dim 0 and are cut to rows ``i:j``. Dense
tensors (any dtype, also tensor subclasses and per-tensor or per-channel quantized tensors) are
sliced, ``leaf[i:j]`` (a view); sparse COO tensors with ``narrow_copy``; 2-D sparse CSR
tensors row by row, and sparse compressed tensors (CSR, CSC, BSR, BSC) with a batch dimension
along it; nested tensors (jagged layout, holes and transposed ones included, or strided layout)
by their components. Refused with ``TypeError`` naming the leaf, its kind and a conversion: 2-D
CSC, BSR and BSC tensors (dim 0 is not what they compress), MKL-DNN tensors and other layouts.
A 0-dim tensor is refused (``ValueError``): it has no rows.

**Per-sample sequences.** A ``list`` or ``tuple`` (exactly those types; a NamedTuple is a record
and is walked) that holds no tensor at any depth (e.g. captions, file names, lists of token
strings, numbers, None, numpy arrays) is one leaf. If its length is ``n`` it is per-sample:
rows ``i:j`` get ``seq[i:j]``, of the same type (the items themselves are neither copied nor
walked). Of any other length it is passed whole to every piece. A list or tuple that holds a
tensor (or a marker below) anywhere is a nesting level: each item follows these rules on its
own. Per-sample sequences do not set ``n``: only tensor leaves and :class:`PerSample` do.

**Other leaves** (str, numbers, None, other objects) are passed to every piece as they are.

**Overrides.** ``PerSample(value)`` cuts ``value`` (a list, tuple or any sliceable sequence of
``n`` items, e.g. a list of tensors of different lengths) whatever it holds, and counts as
``n`` rows; ``Broadcast(value)`` passes ``value`` whole to every piece (a caption list that
happens to have ``n`` entries, a tensor of per-batch constants). Pieces hold the values, not
the markers.

The structure (containers, sequences, markers) lives in :mod:`accumopt._nesting`, the tensor
kinds in :mod:`accumopt._kinds`, the cheap path for the usual batch in :mod:`accumopt._plain`;
this module counts, cuts, moves and joins.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from accumopt import _kinds
from accumopt._nesting import Broadcast, Items, PerSample, flatten
from accumopt._plain import builder, dense, plain

__all__ = [
    "Batch",
    "Broadcast",
    "PerSample",
    "RowSlicer",
    "batch_size",
    "concat",
    "leaf_paths",
    "move",
]

Batch: TypeAlias = Any
"""A tensor, or a nesting of containers (see the module docstring) with tensor leaves."""


def leaf_paths(batch: Batch, api: str = "MicroBatchRunner") -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs, paths written as in Python (``batch['x']``, ``batch[1][0]``).

    Leaves follow the module's rules: a per-sample sequence or a marker is one leaf, a
    Mapping subclass or dataclass is walked. ``api`` starts the message of a ``TypeError``
    for a container that cannot be rebuilt.
    """
    return [
        (p, leaf.value if isinstance(leaf, Items) else leaf) for p, leaf in flatten(batch, api)[0]
    ]


# ---- rows ----------------------------------------------------------------------------------


def _rows_text(leaf: Tensor | PerSample[Any]) -> str:
    if isinstance(leaf, PerSample):
        return f"{len(leaf.value)} rows (a PerSample of {len(leaf.value)} items)"
    shape = f"shape {tuple(leaf.shape)}" if not leaf.is_nested else _kinds.describe(leaf)
    return f"{leaf.size(0)} rows along dim 0 ({shape})"


def _count_rows(leaves: list[tuple[str, Any]], api: str) -> int:
    """The rows ``n`` shared by the tensor leaves and PerSample values (see batch_size)."""
    counted = [(p, leaf) for p, leaf in leaves if isinstance(leaf, (Tensor, PerSample))]
    if not counted:
        values = [leaf.value if isinstance(leaf, Items) else leaf for _, leaf in leaves]
        kinds = sorted({type(v).__qualname__ for v in values}) or ["nothing"]
        raise TypeError(
            f"{api}: batch has no tensor leaf (leaves: {', '.join(kinds)}); expected a "
            "tensor or a dict/list/tuple/NamedTuple nesting with at least one tensor. Convert "
            "arrays with torch.as_tensor first, or wrap a list of samples in "
            "accumopt.split.PerSample."
        )
    for path, leaf in counted:
        if isinstance(leaf, Tensor):
            _kinds.check(path, leaf, api)
    rows = [
        (p, leaf.size(0) if isinstance(leaf, Tensor) else len(leaf.value)) for p, leaf in counted
    ]
    first_path, n = rows[0]
    for (path, leaf), (_, m) in zip(counted[1:], rows[1:]):
        if m != n:
            raise ValueError(
                f"{api}: {path} has {_rows_text(leaf)} but {first_path} has {n}; expected "
                "every tensor leaf to share the batch length. Pass per-batch constants as "
                "non-tensor leaves, or wrap them in accumopt.split.Broadcast."
            )
    if n == 0:
        raise ValueError(
            f"{api}: {first_path} has 0 rows; expected a non-empty batch. Skip empty batches."
        )
    return n


def batch_size(batch: Batch, api: str) -> int:
    """The batch's row count ``n``: the shared, non-zero dim 0 of its tensor leaves (and the
    length of its :class:`PerSample` values). Per-sample lists adapt to it and do not count.

    Raises:
        TypeError: the batch holds no tensor (nor PerSample); a tensor of a kind whose rows
            cannot be cut; a container that cannot be rebuilt.
        ValueError: a 0-dim tensor leaf, leaves that disagree on dim 0, or 0 rows.
        Every message starts with ``api`` and names the offending leaf.
    """
    return _count_rows(flatten(batch, api)[0], api)


_How: TypeAlias = Literal["slice", "tensor", "rows", "whole"]


class RowSlicer:
    """Rows of one batch, moved to a device, many times: the batch is flattened once.

    ``RowSlicer(batch, device)(start, stop)`` is the batch with rows ``start:stop`` of every
    tensor leaf (views of dense tensors; see the module docstring for other kinds) and of
    every per-sample sequence, tensors moved to ``device`` (None: left where they are) with
    :func:`move`, so the full batch can stay in host memory. :meth:`cut` takes the device
    per call; :meth:`split` gives every piece of a fixed size at once. A plain tensor, or a
    tuple, list or dict (exactly those types) of plain dense tensors, is taken apart without
    ``torch.utils._pytree`` (same leaves, paths and pieces, a fraction of the cost).

    Args:
        batch: a batch, by the module's rules.
        device: where ``__call__`` and :meth:`split` move the pieces' tensors; None leaves
            them.
        api: the caller's name, which starts error messages (default: the runner's).

    Attributes:
        rows: the batch's row count ``n`` (see :func:`batch_size`).

    Raises:
        TypeError, ValueError: as :func:`batch_size`, at construction; ``TypeError`` when
            torch cannot cut or move a leaf of a special kind (the message names it).
    """

    def __init__(
        self, batch: Batch, device: torch.device | None, *, api: str = "MicroBatchRunner"
    ) -> None:
        self.device, self.api = device, api
        fast = plain(batch)
        if fast is not None:  # the usual batch: no pytree round trip, every leaf sliced
            self.rows, leaves, self._build = fast
            self.leaves: list[tuple[str, Any, _How]] = [(p, t, "slice") for p, t in leaves]
            return
        leaves, spec = flatten(batch, api)
        self.rows = _count_rows(leaves, api)
        self._build = builder(spec) or functools.partial(pytree.tree_unflatten, treespec=spec)
        self.leaves = [self._plan(p, leaf) for p, leaf in leaves]

    def _plan(self, path: str, leaf: Any) -> tuple[str, Any, _How]:
        if isinstance(leaf, Tensor):
            return path, leaf, "slice" if dense(leaf) else "tensor"
        if isinstance(leaf, (PerSample, Broadcast)):
            return path, leaf.value, "rows" if isinstance(leaf, PerSample) else "whole"
        if isinstance(leaf, Items):
            return path, leaf.value, "rows" if len(leaf.value) == self.rows else "whole"
        return path, leaf, "whole"

    def __call__(self, start: int, stop: int) -> Batch:
        return self.cut(start, stop, self.device)

    def cut(self, start: int, stop: int, device: torch.device | None) -> Batch:
        """Rows ``start:stop`` with their tensors moved to ``device`` (None: not moved)."""
        return self._build(self._values(start, stop, device))

    def split(self, size: int) -> Iterator[tuple[Batch, int]]:
        """``(piece, rows)`` for rows ``0:size``, ``size:2*size``, ... in order (the last piece
        may be shorter), tensors moved to the slicer's ``device`` as each piece is taken.
        Every dense leaf is cut into all its pieces by one ``tensor_split`` (the same views
        as ``leaf[i:j]``); other leaves are cut per piece, as by :meth:`cut`."""
        starts = range(0, self.rows, size)
        stops = [*starts[1:], self.rows]
        columns = [
            t.tensor_split(stops[:-1]) if how == "slice" else None for _, t, how in self.leaves
        ]
        if self.device is None and None not in columns:  # all dense, nothing to move
            pieces: Iterator[Batch] = map(self._build, zip(*columns))
        else:
            pieces = (
                self._build(self._values(start, stop, self.device, columns, k))
                for k, (start, stop) in enumerate(zip(starts, stops))
            )
        return zip(pieces, (stop - start for start, stop in zip(starts, stops)))

    def _values(
        self, start: int, stop: int, device: torch.device | None, columns: Any = None, k: int = 0
    ) -> list[Any]:
        """Every leaf's rows ``start:stop``, moved to ``device``; a dense leaf's rows are
        taken from ``columns`` (a piece ``k`` per leaf) when given, else sliced here."""
        values = []
        for i, (path, leaf, how) in enumerate(self.leaves):
            if how != "slice":
                values.append(self._leaf(path, leaf, how, start, stop, device))
                continue
            part = leaf[start:stop] if columns is None else columns[i][k]
            values.append(part if device is None else move(part, device))
        return values

    def shape_key(self) -> tuple[tuple[str, tuple[Any, ...], str], ...]:
        """What the micro-batch size search remembers a ceiling for: each tensor leaf's path,
        shape past dim 0 and dtype (a batch of longer sequences gets its own ceiling). A
        nested tensor's ragged sizes are written ``"*"``, so its batches share one key."""
        return tuple(
            (path, row_shape(leaf), str(leaf.dtype).removeprefix("torch."))
            for path, leaf, how in self.leaves
            if how in ("slice", "tensor")
        )

    def _leaf(
        self, path: str, leaf: Any, how: _How, start: int, stop: int, device: torch.device | None
    ) -> Any:
        if how == "whole":
            return leaf
        if how == "rows":
            part = leaf[start:stop]
            if device is None or type(part) not in (list, tuple):
                return part
            return type(part)(self._move(path, x, device) for x in part)
        part = _kinds.guard(
            self.api,
            path,
            leaf,
            f"cut at rows {start}:{stop}",
            lambda: _kinds.cut(leaf, start, stop),
        )
        return part if device is None else self._move(path, part, device)

    def _move(self, path: str, x: Any, device: torch.device) -> Any:
        if not isinstance(x, Tensor):
            return x
        return _kinds.guard(self.api, path, x, f"move to {device}", lambda: move(x, device))


def row_shape(t: Tensor) -> tuple[Any, ...]:
    """A tensor's shape past dim 0, ragged (nested) sizes as ``"*"``."""
    if not t.is_nested:
        return tuple(t.shape[1:])
    if t.layout == torch.jagged:
        ragged = t._ragged_idx  # type: ignore[attr-defined]
        return tuple("*" if i == ragged else t.size(i) for i in range(1, t.dim()))
    return ("*",) * (t.dim() - 1)


def move(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor.to(device, non_blocking=True)``; a dense host tensor bound for CUDA is pinned
    first (sparse, nested and quantized tensors are copied without pinning)."""
    if tensor.device == device:
        return tensor
    dense = tensor.layout == torch.strided and not (tensor.is_nested or tensor.is_quantized)
    if device.type == "cuda" and tensor.device.type == "cpu" and dense:
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


# ---- joining pieces back -------------------------------------------------------------------


def concat(
    pieces: Sequence[Batch], *, sizes: Sequence[int] | None = None, api: str = "MicroBatchRunner"
) -> Batch:
    """Join same-structured pieces (per-micro-batch outputs) back along the rows.

    Leaf by leaf: tensors with a dim 0 are concatenated (each kind that :class:`RowSlicer`
    cuts, see the module docstring); a per-sample sequence, i.e. a list or tuple without
    tensors whose length in every piece equals that piece's rows, is concatenated into one of
    the same type, unless every piece holds the very same object (a value passed whole);
    ``PerSample`` lists and tuples are concatenated; anything else (0-dim tensors, other
    values, ``Broadcast`` values) is taken from the first piece. A piece's rows are
    ``sizes[k]`` if given, else the dim 0 its tensor leaves agree on (unknown if they do not
    agree or it has none: its sequences are then taken whole). A list holding tensors is a
    nesting level, so pieces whose such lists differ in length are refused: wrap them in
    ``PerSample``.

    Args:
        pieces: one or more batches with the same nesting.
        sizes: optional row count of each piece.
        api: the caller's name, which starts error messages (default: the runner's).

    Returns:
        The joined batch, with the nesting (and container types) of ``pieces[0]``.

    Raises:
        ValueError: the pieces are nested differently, or ``sizes`` has the wrong length.
        TypeError: a tensor of a kind that cannot be concatenated (the message names it); a
            ``PerSample`` value that is not a list or tuple.
    """
    flats = [flatten(piece, api, root="outputs") for piece in pieces]
    spec = flats[0][1]
    for k, (leaves, other) in enumerate(flats[1:], 1):
        if other != spec:  # the same leaves in another order (dict keys) are joined by path
            flats[k] = (_aligned(leaves, flats[0][0], k, api), spec)
    if sizes is not None and len(sizes) != len(pieces):
        raise ValueError(
            f"{api}: sizes={list(sizes)!r} has {len(sizes)} entries for {len(pieces)} pieces; "
            "expected one row count per piece."
        )
    rows: list[int | None] = (
        list(sizes) if sizes is not None else [_agreed_rows(leaves) for leaves, _ in flats]
    )
    columns = zip(*(leaves for leaves, _ in flats))
    merged = [_join_column([leaf for _, leaf in col], col[0][0], rows, api) for col in columns]
    return pytree.tree_unflatten(merged, spec)


def _aligned(
    leaves: list[tuple[str, Any]], reference: list[tuple[str, Any]], k: int, api: str
) -> list[tuple[str, Any]]:
    """``leaves`` in the order of ``reference``'s paths, or ValueError if the paths differ."""
    by_path = dict(leaves)
    order = [path for path, _ in reference]
    if len(by_path) != len(leaves) or sorted(by_path) != sorted(order):
        missing = sorted(set(order) - set(by_path))[:3]
        extra = sorted(set(by_path) - set(order))[:3]
        raise ValueError(
            f"{api}: outputs[{k}] is nested differently from outputs[0] (missing {missing}, "
            f"extra {extra}: other keys, or lists holding tensors of other lengths); expected "
            "pieces of one structure. Return the same structure from every micro-batch, and "
            "wrap lists of per-sample tensors in accumopt.split.PerSample."
        )
    return [(path, by_path[path]) for path in order]


def _agreed_rows(leaves: list[tuple[str, Any]]) -> int | None:
    rows = {leaf.size(0) for _, leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0}
    rows |= {len(leaf.value) for _, leaf in leaves if isinstance(leaf, PerSample)}
    return rows.pop() if len(rows) == 1 else None


def _join_column(column: list[Any], path: str, rows: list[int | None], api: str) -> Any:
    first = column[0]
    if isinstance(first, Tensor) and first.dim() > 0:
        for t in column:
            _kinds.check(path, t, api)
        return _kinds.guard(
            api, path, first, "concatenate along dim 0", lambda: _kinds.join(column)
        )
    if isinstance(first, PerSample):
        values = [leaf.value for leaf in column]
        if type(values[0]) not in (list, tuple):
            raise TypeError(
                f"{api}: {path}={first!r} holds a {type(values[0]).__qualname__}; expected a "
                "list or tuple to concatenate. Return a list, or a tensor."
            )
        return type(values[0])(itertools.chain.from_iterable(values))
    if isinstance(first, Broadcast):
        return first.value
    if not isinstance(first, Items):
        return first
    values = [leaf.value if isinstance(leaf, Items) else leaf for leaf in column]
    same_kind = all(type(v) is type(values[0]) for v in values)
    passed_whole = all(v is values[0] for v in values)
    if same_kind and not passed_whole and all(len(v) == r for v, r in zip(values, rows)):
        return type(values[0])(itertools.chain.from_iterable(values))
    return values[0]

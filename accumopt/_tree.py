"""Nested batches: count their rows, cut rows ``i:j`` out of them, join pieces back.

The rules are docs/guide/several-devices.md, "What a batch may hold": rows ``n`` are dim 0 of
the tensor leaves; ``Mapping`` subclasses and dataclasses are rebuilt as
``type(obj)(dict_of_items)`` and ``type(obj)(**init_fields)`` (:func:`_take_apart`);
:func:`check` refuses tensor kinds; a ``list`` or ``tuple`` (exactly) holding no tensor is cut if
its length is ``n`` and sets no ``n``. The usual batch (a dense tensor, or a tuple, list or dict
of them) skips pytree.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeAlias, TypeVar

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from accumopt.oom import is_oom

Batch: TypeAlias = Any
"""A tensor, or a nesting of containers with tensor leaves (the module's rules)."""

T = TypeVar("T")
short = reprlib.repr  # repr(value) shortened for error messages (a list of 4096 captions...)
_SCALARS = (str, bytes, int, float, complex, type(None))
_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_DENSE_HINT = "Convert it with .to_dense(), or wrap it in accumopt.split.Broadcast(...)."


class _Wrapped(Generic[T]):
    """A value that :func:`flatten` keeps as one leaf."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({short(self.value)})"


class PerSample(_Wrapped[T]):
    """Mark ``value`` as per-sample: the piece of rows ``i:j`` gets ``value[i:j]`` (tensors in it
    moved to its device), and it counts as ``len(value)`` rows; of a tensor, that tensor.
    TypeError: no ``len()`` or slicing. ``{"boxes": PerSample([b_0, b_1, b_2]), ...}``"""

    __slots__ = ()

    def __init__(self, value: T) -> None:
        if not (hasattr(value, "__len__") and hasattr(value, "__getitem__")):
            raise TypeError(
                f"PerSample: value={short(value)} has no len() or no slicing; expected a sequence "
                "with one item per sample. Wrap it in Broadcast(...), or leave it unwrapped."
            )
        super().__init__(value)


class Broadcast(_Wrapped[T]):
    """Mark ``value`` as per-batch (a tuple of length ``n`` by chance, a tensor of constants):
    every piece gets it whole, not walked, cut, moved or counted. ``Broadcast((3, 224, 224))``"""

    __slots__ = ()


class Items(_Wrapped["list[Any] | tuple[Any, ...]"]):
    """A list or tuple that holds no tensor, as one leaf of :func:`flatten`."""

    __slots__ = ()


@dataclasses.dataclass
class _Node:
    """A foreign container taken apart: its values, and ``(type, keys, is_mapping)``."""

    children: list[Any]
    context: tuple[type, tuple[Any, ...], bool]


def _rebuild(values: Iterable[Any], context: Any) -> Any:
    cls, keys, mapping = context
    items = dict(zip(keys, values))
    return cls(items) if mapping else cls(**items)


def _keyed(node: _Node) -> tuple[list[tuple[pytree.KeyEntry, Any]], Any]:
    _, keys, mapping = node.context
    key = pytree.MappingKey if mapping else pytree.GetAttrKey
    return [(key(k), child) for k, child in zip(keys, node.children)], node.context


pytree.register_pytree_node(
    _Node,
    lambda node: (node.children, node.context),
    _rebuild,
    flatten_with_keys_fn=_keyed,
    serialized_type_name="accumopt._tree._Node",
)


def _is_foreign(x: object) -> bool:
    """A container pytree does not walk: a Mapping subclass or a dataclass instance."""
    if not pytree.tree_is_leaf(x) or isinstance(x, Tensor):
        return False
    return isinstance(x, Mapping) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def _items(x: Any) -> dict[Any, Any]:
    if isinstance(x, Mapping):
        return {k: x[k] for k in x}
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}


def _holds_tensor(tree: Any) -> bool:
    """Whether a tensor or a marker is anywhere inside ``tree`` (fast on long lists of str)."""
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, _SCALARS):
            continue
        if isinstance(x, (Tensor, PerSample, Broadcast)):
            return True
        if type(x) in (list, tuple):
            stack.extend(x)
        elif _is_foreign(x):
            stack.extend(_items(x).values())
        elif not pytree.tree_is_leaf(x):  # its direct children (the lambda is called at once)
            stack.extend(pytree.tree_leaves(x, is_leaf=lambda y: y is not x))  # noqa: B023
    return False


def _prepare(tree: Any, prefix: pytree.KeyPath, api: str, root: str) -> Any:
    """``tree``, foreign containers as :class:`_Node`, tensor-free lists or tuples as Items."""
    free: dict[int, bool] = {}  # id -> tensor-free list/tuple; pytree asks twice per node

    def stops(x: Any) -> bool:
        if isinstance(x, (PerSample, Broadcast)) or _is_foreign(x):
            return True
        if type(x) not in (list, tuple):
            return False
        if id(x) not in free:
            free[id(x)] = not _holds_tensor(x)
        return free[id(x)]

    def convert(path: pytree.KeyPath, x: Any) -> Any:
        if _is_foreign(x):
            return _take_apart(x, prefix + path, api, root)
        if type(x) in (list, tuple):
            return Items(x)
        if isinstance(x, PerSample) and isinstance(x.value, Tensor):
            return x.value
        return x

    return pytree.tree_map_with_path(convert, tree, is_leaf=stops)


def _take_apart(obj: Any, path: pytree.KeyPath, api: str, root: str) -> _Node:
    items, mapping = _items(obj), isinstance(obj, Mapping)
    context = (type(obj), tuple(items), mapping)
    try:
        same = type(_rebuild(list(items.values()), context)) is type(obj)
        problem = "rebuilds as another type"
    except Exception as err:  # any failure of the user's constructor
        same, problem = False, f"cannot be rebuilt from its items ({type(err).__name__}: {err})"
    if not same:
        how = "type(obj)(dict_of_items)" if mapping else "type(obj)(**init_fields)"
        raise TypeError(
            f"{api}: {root}{pytree.keystr(path)}={short(obj)} is a {type(obj).__qualname__} that "
            f"{problem}; expected a container that {how} rebuilds with its cut items. Convert it "
            "to a dict, or wrap it in accumopt.split.Broadcast(...) to pass it whole."
        )
    key = pytree.MappingKey if mapping else pytree.GetAttrKey
    return _Node([_prepare(v, (*path, key(k)), api, root) for k, v in items.items()], context)


def flatten(tree: Any, api: str, root: str = "batch") -> tuple[list[tuple[str, Any]], Any]:
    """``([(path, leaf), ...], spec)``, paths from ``root`` (``batch['x'][0]``), tensor-free lists
    and tuples as :class:`Items`; ``pytree.tree_unflatten(values, spec)`` rebuilds the nesting.
    TypeError (starting with ``api``) for a container that cannot be rebuilt."""
    prepared = _prepare(tree, (), api, root)
    flat, spec = pytree.tree_flatten_with_path(prepared, is_leaf=lambda x: isinstance(x, _Wrapped))
    return [(root + pytree.keystr(path), leaf) for path, leaf in flat], spec


def dense(t: Tensor) -> bool:
    """A plain dense tensor (cut by slicing): not a subclass, sparse, nested or quantized."""
    return type(t) is Tensor and t.layout == torch.strided and not (t.is_nested or t.is_quantized)


def plain(batch: Any) -> tuple[list[tuple[str, Tensor]], Callable[[Any], Any]] | None:
    """``([(path, leaf), ...], rebuild)`` without pytree for a dense tensor, or a ``tuple``,
    ``list`` or ``dict`` (exactly) of dense tensors with a dim 0, with :func:`flatten`'s paths;
    ``rebuild(values)`` makes the batch anew. None for any other batch."""
    kind = type(batch)
    build: Callable[[Any], Any]
    if kind is Tensor:
        leaves, build = [("batch", batch)], operator.itemgetter(0)
    elif kind is tuple or kind is list:
        leaves, build = [(f"batch[{i}]", leaf) for i, leaf in enumerate(batch)], kind
    elif kind is dict:
        leaves = [(f"batch[{key!r}]", leaf) for key, leaf in batch.items()]
        build = functools.partial(_zip_dict, list(batch))
    else:
        return None
    return (leaves, build) if leaves and all(dense(t) and t.dim() > 0 for _, t in leaves) else None


def _zip_dict(keys: list[Any], values: Any) -> dict[Any, Any]:
    return dict(zip(keys, values))


def _kind(t: Tensor) -> tuple[str, str]:
    """What ``t`` is (``'tensor'`` for a plain dense tensor), and how to make it one."""
    if t.is_nested:
        layout = "jagged" if t.layout == torch.jagged else "strided"
        remedy = "Convert it with .to_padded_tensor(0.0), or pass PerSample(list(t.unbind()))."
        return f"nested tensor ({layout} layout)", remedy
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')} tensor", _DENSE_HINT
    if t.is_quantized:
        scheme = str(t.qscheme()).removeprefix("torch.")
        return f"quantized tensor ({scheme})", "Dequantize it with .dequantize() first."
    if type(t) is not Tensor:
        remedy = "Pass it as t.as_subclass(torch.Tensor), or wrap it in accumopt.split.Broadcast."
        return f"tensor subclass {type(t).__qualname__}", remedy
    return "tensor", _DENSE_HINT


def check(path: str, t: Tensor, api: str) -> None:
    """Refuse a 0-dim tensor leaf (``ValueError``) or one whose rows cannot be cut: 2-D sparse
    CSC/BSR/BSC, MKL-DNN, other layouts (``TypeError``); messages start with ``api``."""
    if t.dim() == 0:
        value = f"tensor({t.item()!r})" if t.layout == torch.strided else short(t)
        raise ValueError(
            f"{api}: {path}={value} is a 0-dim tensor; expected tensor leaves with a batch "
            "dimension (dim 0). Pass a per-batch scalar as a number, or give it a dim of n rows."
        )
    compressed = t.layout in _COMPRESSED
    if compressed and _compressed_indices(t)[0].dim() > 1:  # a batch dimension: dim 0 cuts
        return
    if t.layout in (torch.strided, torch.sparse_coo, torch.jagged, torch.sparse_csr):
        return
    fix = "Convert it with .to_sparse_csr(), .to_sparse_coo() or .to_dense()."
    raise TypeError(
        f"{api}: {path} is a {_kind(t)[0]}, whose rows (dim 0) accumopt cannot cut; expected a "
        f"dense, sparse COO, CSR or batched compressed, nested or quantized tensor. "
        f"{fix if compressed else _DENSE_HINT}"
    )


def guard(api: str, path: str, t: Tensor, doing: str, op: Callable[[], Tensor]) -> Tensor:
    """``op()``; torch's error on a tensor of a special kind becomes a ``TypeError`` naming the
    leaf and what to do (out-of-memory errors and plain tensors' errors pass through)."""
    try:
        return op()
    except Exception as err:
        kind, remedy = _kind(t)
        if kind == "tensor" or is_oom(err):
            raise
        text = (str(err).strip().splitlines() or [""])[0]
        raise TypeError(
            f"{api}: {path} is a {kind} that torch could not {doing} ({type(err).__name__}: "
            f"{text}); expected a tensor kind that supports it. {remedy}"
        ) from err


def cut(t: Tensor, start: int, stop: int) -> Tensor:
    """Rows ``start:stop`` (dim 0) of a tensor of any kind that :func:`check` accepts."""
    if t.is_nested:
        if t.layout == torch.jagged:
            values, offsets, lengths, dim = _jagged(t)
            low, high = int(offsets[start]), int(offsets[stop])
            piece = values.narrow(dim, low, high - low), offsets[start : stop + 1] - low
            holes = None if lengths is None else lengths[start:stop]
            return torch.nested.nested_tensor_from_jagged(*piece, lengths=holes, jagged_dim=dim + 1)
        if start == stop:  # torch's narrow fails or keeps one component here
            return torch.nested.nested_tensor([], dtype=t.dtype, device=t.device)
        return t.narrow(0, start, stop - start).contiguous()  # .to() needs it contiguous
    if t.is_quantized and start == stop and t.qscheme() != torch.per_tensor_affine:
        if t.q_per_channel_axis() != 0:  # torch's empty slice of a per-channel one fails
            return t[:0]
        scales, zero_points = t.q_per_channel_scales()[:0], t.q_per_channel_zero_points()[:0]
        return torch.quantize_per_channel(t.dequantize()[:0], scales, zero_points, 0, t.dtype)
    if t.layout == torch.sparse_coo:
        return t.narrow_copy(0, start, stop - start)
    if t.layout not in _COMPRESSED:
        return t[start:stop]
    compressed, other, values = *_compressed_indices(t), t.values()
    if compressed.dim() > 1:  # a batch dimension: dim 0 of every component
        parts = compressed[start:stop], other[start:stop], values[start:stop]
    else:  # 2-D CSR: rows start:stop hold entries low:high
        low, high = int(compressed[start]), int(compressed[stop])
        parts = compressed[start : stop + 1] - low, other[low:high], values[low:high]
    size = (stop - start, *t.shape[1:])
    return torch.sparse_compressed_tensor(*parts, size=size, layout=t.layout)


def join(parts: Sequence[Tensor]) -> Tensor:
    """Concatenate same-kind tensors along dim 0; the inverse of :func:`cut`."""
    first = parts[0]
    if first.is_nested and first.layout == torch.jagged:
        flat, offsets, lengths, dims = zip(*map(_jagged, parts))
        extents = [v.size(dims[0]) for v in flat]
        shifts = itertools.accumulate(extents[:-1], initial=0)
        starts = [o[:-1] + shift for o, shift in zip(offsets, shifts)]
        if all(n is None for n in lengths):
            holes = None
        else:  # a component's length is where the next starts unless it has a hole
            holes = torch.cat([o.diff() if n is None else n for o, n in zip(offsets, lengths)])
        end = offsets[0].new_tensor([sum(extents)])
        new = torch.cat(flat, dims[0]), torch.cat([*starts, end])  # values, offsets
        return torch.nested.nested_tensor_from_jagged(*new, lengths=holes, jagged_dim=dims[0] + 1)
    if first.layout in _COMPRESSED:
        indices = [_compressed_indices(p) for p in parts]
        values = torch.cat([p.values() for p in parts])
        if indices[0][0].dim() > 1:
            compressed = torch.cat([c for c, _ in indices])
        else:
            shifts = itertools.accumulate((int(c[-1]) for c, _ in indices), initial=0)
            starts = [c[:-1] + shift for (c, _), shift in zip(indices, shifts)]
            compressed = torch.cat([*starts, indices[0][0].new_tensor([values.size(0)])])
        other, size = torch.cat([p for _, p in indices]), (sum(map(len, parts)), *first.shape[1:])
        return torch.sparse_compressed_tensor(compressed, other, values, size, layout=first.layout)
    if first.is_nested:  # an empty nested tensor has no trailing dimensions: leave it out
        return torch.cat([p.contiguous() for p in parts if p.size(0) > 0] or [first])
    return torch.cat(list(parts))


def _jagged(t: Tensor) -> tuple[Tensor, Tensor, Tensor | None, int]:
    """A jagged nested tensor's ``(values, offsets, lengths, dim)``: component ``k`` starts at
    ``offsets[k]`` along ``dim`` and is ``lengths[k]`` long (None: up to the next one)."""
    nt: Any = t  # NestedTensor's accessors are not in the Tensor stubs
    return nt.values(), nt.offsets(), nt.lengths(), int(nt._ragged_idx) - 1


def _compressed_indices(t: Tensor) -> tuple[Tensor, Tensor]:
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def row_shape(t: Tensor) -> tuple[Any, ...]:
    """A tensor's shape past dim 0, ragged (nested) sizes as ``"*"``."""
    if not t.is_nested:
        return tuple(t.shape[1:])
    if t.layout == torch.jagged:
        ragged = t._ragged_idx  # type: ignore[attr-defined]
        return tuple("*" if i == ragged else t.size(i) for i in range(1, t.dim()))
    return ("*",) * (t.dim() - 1)


def move(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor.to(device, non_blocking=True)``, a dense host tensor bound for CUDA pinned first."""
    if tensor.device == device:
        return tensor
    host = tensor.device.type == "cpu" and tensor.layout == torch.strided
    if device.type == "cuda" and host and not (tensor.is_nested or tensor.is_quantized):
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _count_rows(leaves: list[tuple[str, Any]], api: str) -> int:
    """The rows ``n`` shared by the tensor leaves and PerSample values (see batch_size)."""
    counted = [(p, leaf) for p, leaf in leaves if isinstance(leaf, (Tensor, PerSample))]
    if not counted:
        values = [leaf.value if isinstance(leaf, Items) else leaf for _, leaf in leaves]
        kinds = sorted({type(v).__qualname__ for v in values}) or ["nothing"]
        raise TypeError(
            f"{api}: batch has no tensor leaf (leaves: {', '.join(kinds)}); expected at least one "
            "tensor. Convert arrays with torch.as_tensor, or wrap a list of samples in PerSample."
        )
    first_path, n = "", -1
    for path, leaf in counted:
        if isinstance(leaf, Tensor):
            check(path, leaf, api)
        m = leaf.size(0) if isinstance(leaf, Tensor) else len(leaf.value)
        if n < 0:
            first_path, n = path, m
        elif m != n:
            if isinstance(leaf, PerSample):
                has = f"{m} rows (a PerSample of {m} items)"
            else:
                shape = _kind(leaf)[0] if leaf.is_nested else f"shape {tuple(leaf.shape)}"
                has = f"{m} rows along dim 0 ({shape})"
            raise ValueError(
                f"{api}: {path} has {has} but {first_path} has {n}; expected one batch length. "
                "Pass per-batch constants as non-tensors, or wrap them in accumopt.Broadcast."
            )
    if n == 0:
        raise ValueError(
            f"{api}: {first_path} has 0 rows; expected a non-empty batch. Skip empty batches."
        )
    return n


def batch_size(batch: Batch, api: str) -> int:
    """The batch's rows ``n``: the shared, non-zero dim 0 of its tensor leaves and PerSample
    values. Raises (starting with ``api``) TypeError: no tensor (nor PerSample), a tensor whose
    rows cannot be cut, a container that cannot be rebuilt; ValueError: a 0-dim tensor leaf,
    leaves that disagree on dim 0, or 0 rows."""
    return _count_rows(flatten(batch, api)[0], api)


class RowSlicer:
    """Rows of one batch, flattened once: ``RowSlicer(batch, device)(start, stop)`` is the batch
    with rows ``start:stop`` of every tensor leaf and per-sample sequence, tensors moved to
    ``device`` (None: not moved) by :func:`move`. ``rows`` is the batch's ``n``; ``api`` starts
    messages. Raises as :func:`batch_size` when built, TypeError where torch cannot cut or move.
    """

    def __init__(
        self, batch: Batch, device: torch.device | None, *, api: str = "MicroBatchRunner"
    ) -> None:
        self.device, self.api = device, api
        fast = plain(batch)
        if fast is None:
            leaves, spec = flatten(batch, api)
            fast = leaves, functools.partial(pytree.tree_unflatten, treespec=spec)
        leaves, self._build = fast
        self.rows = _count_rows(leaves, api)
        self.leaves: list[tuple[str, Any, str]] = []  # how: "slice", "tensor", "rows", "whole"
        for path, leaf in leaves:
            value = leaf.value if isinstance(leaf, _Wrapped) else leaf
            if isinstance(leaf, Tensor):
                how = "slice" if dense(leaf) else "tensor"
            else:
                cut_rows = isinstance(leaf, Items) and len(value) == self.rows
                how = "rows" if cut_rows or isinstance(leaf, PerSample) else "whole"
            self.leaves.append((path, value, how))

    def __call__(self, start: int, stop: int) -> Batch:
        return self.cut(start, stop, self.device)

    def cut(self, start: int, stop: int, device: torch.device | None) -> Batch:
        """Rows ``start:stop`` with their tensors moved to ``device`` (None: not moved)."""
        return self._place(self._slices(start, stop), device)

    def take(self, rows: Sequence[int], length: int = 0, trim: Iterable[int] = ()) -> Batch:
        """The batch of ``rows``, moved to the device: a ``range`` is cut as :meth:`cut`, other
        rows are gathered (from dense tensor leaves and per-sample sequences; TypeError for
        other tensor kinds); the dense leaves numbered ``trim`` are cut to ``length`` along
        dim 1."""
        if isinstance(rows, range) and rows.step == 1:
            parts = self._slices(rows.start, rows.stop)
        else:
            parts = self._gather(rows)
        for k in trim:
            parts[k] = parts[k][:, :length]
        return self._place(parts, self.device)

    def _slices(self, start: int, stop: int) -> list[Any]:
        parts: list[Any] = []
        for path, leaf, how in self.leaves:
            part: Any = leaf
            if how == "tensor":
                op = functools.partial(cut, leaf, start, stop)
                part = guard(self.api, path, leaf, f"cut at rows {start}:{stop}", op)
            elif how != "whole":
                part = leaf[start:stop]
            parts.append(part)
        return parts

    def _gather(self, rows: Sequence[int]) -> list[Any]:
        index = torch.tensor(list(rows), dtype=torch.long)
        parts: list[Any] = []
        for path, leaf, how in self.leaves:
            part: Any = leaf
            if how in ("slice", "tensor"):
                op = functools.partial(torch.index_select, leaf, 0, index.to(leaf.device))
                part = guard(self.api, path, leaf, "gather rows from for sort=True", op)
            elif how == "rows":
                picked = [leaf[i] for i in rows]
                part = type(leaf)(picked) if type(leaf) in (list, tuple) else picked
            parts.append(part)
        return parts

    def _place(self, parts: list[Any], device: torch.device | None) -> Batch:
        """The batch rebuilt from one part per leaf, its tensors moved to ``device``."""
        values: list[Any] = []
        for (path, _, how), part in zip(self.leaves, parts):
            if device is None or how == "whole":
                values.append(part)
            elif type(part) in (list, tuple):
                values.append(type(part)(self._move(path, x, device) for x in part))
            else:
                values.append(self._move(path, part, device))
        return self._build(values)

    def split(self, size: int) -> Iterator[tuple[Batch, int]]:
        """``(piece, rows)`` for rows ``0:size``, ``size:2*size``, ..., moved to ``device``."""
        for start in range(0, self.rows, size):
            stop = min(start + size, self.rows)
            yield self(start, stop), stop - start

    def shape_key(self) -> tuple[tuple[str, tuple[Any, ...], str], ...]:
        """Per tensor leaf ``(path, row_shape, dtype)``: the size search's ceiling is per key."""
        return tuple(
            (path, row_shape(leaf), str(leaf.dtype).removeprefix("torch."))
            for path, leaf, how in self.leaves
            if how in ("slice", "tensor")
        )

    def _move(self, path: str, x: Any, device: torch.device) -> Any:
        if not isinstance(x, Tensor):
            return x
        return guard(self.api, path, x, f"move to {device}", functools.partial(move, x, device))


def concat(
    pieces: Sequence[Batch], *, sizes: Sequence[int] | None = None, api: str = "MicroBatchRunner"
) -> Batch:
    """Join same-structured pieces (per-micro-batch outputs) along the rows into the nesting of
    ``pieces[0]``: tensors with a dim 0, ``PerSample`` lists or tuples, and a tensor-free list or
    tuple as long as its piece's rows in every piece (``sizes[k]``, else the dim 0 its tensors
    agree on) unless it is one object; the rest from the first piece. ValueError: pieces nested
    differently, ``sizes`` of the wrong length; TypeError: a tensor that cannot be concatenated
    (named), a ``PerSample`` value that is not a list or tuple."""
    flats = [flatten(piece, api, root="outputs") for piece in pieces]
    spec, order = flats[0][1], [path for path, _ in flats[0][0]]
    for k, (leaves, other) in enumerate(flats[1:], 1):
        if other == spec:
            continue
        by_path = dict(leaves)  # the same leaves in another order (dict keys) are joined by path
        if len(by_path) != len(leaves) or sorted(by_path) != sorted(order):
            missing = sorted(set(order) - set(by_path))[:3]
            extra = sorted(set(by_path) - set(order))[:3]
            raise ValueError(
                f"{api}: outputs[{k}] is nested differently from outputs[0] (missing {missing}, "
                f"extra {extra}); expected one structure. Return the same structure from every "
                "micro-batch; wrap lists of per-sample tensors in accumopt.PerSample."
            )
        flats[k] = ([(path, by_path[path]) for path in order], spec)
    if sizes is not None and len(sizes) != len(pieces):
        raise ValueError(
            f"{api}: sizes={list(sizes)!r} has {len(sizes)} entries for {len(pieces)} pieces; "
            "expected one row count per piece."
        )
    rows = list(sizes) if sizes is not None else [_agreed_rows(leaves) for leaves, _ in flats]
    columns = zip(*(leaves for leaves, _ in flats))
    merged = [_join_column([leaf for _, leaf in col], col[0][0], rows, api) for col in columns]
    return pytree.tree_unflatten(merged, spec)


def _agreed_rows(leaves: list[tuple[str, Any]]) -> int | None:
    rows = {leaf.size(0) for _, leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0}
    rows |= {len(leaf.value) for _, leaf in leaves if isinstance(leaf, PerSample)}
    return rows.pop() if len(rows) == 1 else None


def _join_column(column: list[Any], path: str, rows: Sequence[int | None], api: str) -> Any:
    first = column[0]
    if isinstance(first, Tensor) and first.dim() > 0:
        for t in column:
            check(path, t, api)
        return guard(api, path, first, "concatenate along dim 0", lambda: join(column))
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

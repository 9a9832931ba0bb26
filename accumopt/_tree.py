"""Nested batches: count their rows, cut rows ``i:j`` out of them, join pieces back.

A batch is a tensor or a nesting of containers; its rows ``n`` are dim 0 of its tensor leaves.
:class:`RowSlicer` (the runner, ``accumopt.apply``, ``micro_split``) and :func:`concat` follow
these rules:

- **Containers**: what ``torch.utils._pytree`` walks, plus ``Mapping`` subclasses (rebuilt as
  ``type(obj)(dict_of_items)``) and dataclass instances (``dataclasses.replace`` of the
  ``init=True`` fields); one that does not rebuild as its own class is a ``TypeError``.
- **Tensor leaves** share ``n``. Dense ones (subclasses, quantized) are sliced as views; sparse
  COO, 2-D CSR, batched sparse compressed and nested ones are cut their own way. 2-D
  CSC/BSR/BSC, MKL-DNN and other layouts are a ``TypeError``, a 0-dim tensor a ``ValueError``.
- **Per-sample sequences**: a ``list`` or ``tuple`` (exactly) holding no tensor is one leaf,
  cut if its length is ``n``, else whole; it does not set ``n``. **Other leaves** go whole.
- **Markers**: a :class:`PerSample` value is always cut and counts as ``n`` rows, a
  :class:`Broadcast` value never cut, moved or counted.

The usual batch (a dense tensor, or a tuple, list or dict of them) skips pytree: :func:`plain`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, TypeAlias, TypeVar

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from accumopt.oom import is_oom

Batch: TypeAlias = Any
"""A tensor, or a nesting of containers with tensor leaves (the module's rules)."""

T = TypeVar("T")


# ---- markers -------------------------------------------------------------------------------------


class _Wrapped(Generic[T]):
    """A value that :func:`flatten` keeps as one leaf."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({short(self.value)})"


class PerSample(_Wrapped[T]):
    """Mark ``value`` as per-sample: each piece gets ``value[i:j]`` for its rows ``i:j``.

    For a sequence the default rule would not cut (``n`` tensors of different lengths, each
    moved to the piece's device, or a numpy array); it counts as ``len(value)`` rows. A
    ``PerSample`` of a tensor is that tensor. TypeError where ``value`` has no ``len()`` or no
    slicing. Example: ``{"img": images, "boxes": PerSample([boxes_0, boxes_1, boxes_2])}``.
    """

    __slots__ = ()

    def __init__(self, value: T) -> None:
        if not (hasattr(value, "__len__") and hasattr(value, "__getitem__")):
            raise TypeError(
                f"PerSample: value={short(value)} has no len() or no slicing; expected a list, "
                "tuple or other sequence with one item per sample. Wrap such a value in "
                "Broadcast(...) to pass it whole, or leave it unwrapped."
            )
        super().__init__(value)


class Broadcast(_Wrapped[T]):
    """Mark ``value`` as per-batch: every piece gets ``value`` itself, neither walked, cut,
    moved nor counted as rows. For a list or tuple whose length happens to be ``n``, or a
    tensor of per-batch constants. Example: ``{"x": x, "size": Broadcast((3, 224, 224))}``.
    """

    __slots__ = ()


class Items(_Wrapped["list[Any] | tuple[Any, ...]"]):
    """A list or tuple that holds no tensor, as one leaf of :func:`flatten`."""

    __slots__ = ()


def short(value: object) -> str:
    """``repr(value)``, shortened for error messages (a list of 4096 captions...)."""
    return reprlib.repr(value)


# ---- walking: containers pytree does not know ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rebuild:
    """How a Mapping subclass or dataclass instance is rebuilt from its (cut) items."""

    cls: type
    keys: tuple[Any, ...]
    original: Any = dataclasses.field(compare=False, repr=False)

    def __call__(self, values: Sequence[Any]) -> Any:
        items = dict(zip(self.keys, values))
        if isinstance(self.original, Mapping):
            return self.cls(items)
        return dataclasses.replace(self.original, **items)

    def key(self, name: Any) -> pytree.KeyEntry:
        return (pytree.MappingKey if isinstance(self.original, Mapping) else pytree.GetAttrKey)(
            name
        )


class _Node:
    """A Mapping subclass or dataclass instance taken apart, for the length of one flatten."""

    __slots__ = ("children", "rebuild")

    def __init__(self, children: list[Any], rebuild: _Rebuild) -> None:
        self.children, self.rebuild = children, rebuild


pytree.register_pytree_node(
    _Node,
    lambda node: (node.children, node.rebuild),
    lambda values, rebuild: rebuild(list(values)),
    flatten_with_keys_fn=lambda node: (
        [(node.rebuild.key(k), c) for k, c in zip(node.rebuild.keys, node.children)],
        node.rebuild,
    ),
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


_SCALARS = (str, bytes, int, float, complex, type(None))


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
        elif not pytree.tree_is_leaf(x):
            stack.extend(_children(x))
    return False


def _children(node: Any) -> list[Any]:
    """The direct children of a pytree node."""
    return pytree.tree_leaves(node, is_leaf=lambda x: x is not node)


def _prepare(tree: Any, prefix: pytree.KeyPath, api: str, root: str) -> Any:
    """``tree`` with every foreign container replaced by a :class:`_Node` (rebuilt on
    unflatten) and every tensor-free list or tuple by an :class:`Items` leaf."""
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
    items = _items(obj)
    rebuild = _Rebuild(type(obj), tuple(items), obj)
    try:
        same = type(rebuild(list(items.values()))) is type(obj)
        problem = "rebuilds as another type"
    except Exception as err:  # any failure of the user's constructor
        same, problem = False, f"cannot be rebuilt from its items ({type(err).__name__}: {err})"
    if not same:
        how = "type(obj)(dict_of_items)" if isinstance(obj, Mapping) else "dataclasses.replace"
        where, kind = root + pytree.keystr(path), type(obj).__qualname__
        raise TypeError(
            f"{api}: {where}={short(obj)} is a {kind} that {problem}; "
            f"expected a container that {how} rebuilds with its cut items. Convert it to a "
            "dict, or wrap it in accumopt.split.Broadcast(...) to pass it whole."
        )
    children = [_prepare(v, (*path, rebuild.key(k)), api, root) for k, v in items.items()]
    return _Node(children, rebuild)


def flatten(tree: Any, api: str, root: str = "batch") -> tuple[list[tuple[str, Any]], Any]:
    """``([(path, leaf), ...], spec)`` by the module's rules, paths as in Python from ``root``
    (``batch['x'][0]``); a tensor-free list or tuple is an :class:`Items` leaf, a marker itself.
    ``pytree.tree_unflatten(values, spec)`` rebuilds the nesting. TypeError (starting with
    ``api``) for a Mapping subclass or dataclass that cannot be rebuilt."""
    prepared = _prepare(tree, (), api, root)
    flat, spec = pytree.tree_flatten_with_path(prepared, is_leaf=lambda x: isinstance(x, _Wrapped))
    return [(root + pytree.keystr(path), leaf) for path, leaf in flat], spec


# ---- the usual batch, without pytree -------------------------------------------------------------

Rebuild = Callable[[Any], Any]
"""Rebuilds a batch from its leaves' values, in flattening order (a list or tuple)."""


def _strided(t: Tensor) -> bool:
    return t.layout == torch.strided and not (t.is_nested or t.is_quantized)


def dense(t: Tensor) -> bool:
    """A plain dense tensor (cut by slicing): not a subclass, sparse, nested or quantized."""
    return type(t) is Tensor and _strided(t)


def plain(batch: Any) -> tuple[int, list[tuple[str, Tensor]], Rebuild] | None:
    """``(rows, [(path, leaf), ...], rebuild)`` of a plain dense tensor, or of a ``tuple``,
    ``list`` or ``dict`` (exactly) of plain dense tensors that agree on a non-zero dim 0, with
    :func:`flatten`'s paths; None for any other batch (flattened in full by the caller)."""
    kind = type(batch)
    build: Rebuild
    if kind is Tensor:
        leaves, build = [("batch", batch)], operator.itemgetter(0)
    elif kind is tuple or kind is list:
        leaves, build = [(f"batch[{i}]", leaf) for i, leaf in enumerate(batch)], kind
    elif kind is dict:
        leaves, keys = [(f"batch[{key!r}]", leaf) for key, leaf in batch.items()], list(batch)

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


# ---- tensor kinds along dim 0 --------------------------------------------------------------------

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


def check(path: str, t: Tensor, api: str) -> None:
    """Refuse a 0-dim tensor leaf (``ValueError``) or one whose rows cannot be cut: 2-D sparse
    CSC/BSR/BSC, MKL-DNN, other layouts (``TypeError``); messages start with ``api``."""
    if t.dim() == 0:
        value = f"tensor({t.item()!r})" if t.layout == torch.strided else short(t)
        raise ValueError(
            f"{api}: {path}={value} is a 0-dim tensor; expected tensor leaves with a batch "
            "dimension (dim 0). Pass a per-batch scalar as a Python number, or give it a "
            "leading dimension of the batch length."
        )
    if t.layout in _COMPRESSED and t.layout != torch.sparse_csr:
        if _compressed_indices(t)[0].dim() != 1:  # a batch dimension: dim 0 can be cut
            return
        refusal = "Convert it with .to_sparse_csr() or .to_sparse_coo(), or .to_dense()."
    elif t.layout in (torch.strided, torch.sparse_coo, torch.jagged, torch.sparse_csr):
        return
    else:
        refusal = _DENSE_HINT
    raise TypeError(
        f"{api}: {path} is a {describe(t)}, whose rows (dim 0) accumopt cannot cut; expected "
        "a dense, sparse COO, sparse CSR, batched sparse compressed, nested or quantized "
        f"tensor. {refusal}"
    )


def guard(api: str, path: str, t: Tensor, doing: str, op: Callable[[], Tensor]) -> Tensor:
    """``op()``; torch's error on a tensor of a special kind becomes a ``TypeError`` naming the
    leaf and what to do (out-of-memory errors and plain tensors' errors pass through)."""
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
        if t.q_per_channel_axis() != 0:  # torch's empty slice of a per-channel one fails
            return t[:0]
        scales, zero_points = t.q_per_channel_scales()[:0], t.q_per_channel_zero_points()[:0]
        return torch.quantize_per_channel(t.dequantize()[:0], scales, zero_points, 0, t.dtype)
    if t.layout == torch.sparse_coo:
        return t.narrow_copy(0, start, stop - start)
    if t.layout in _COMPRESSED:
        return _cut_compressed(t, start, stop)
    return t[start:stop]


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
    lengths = [j.offsets.diff() if j.lengths is None else j.lengths for j in js] if holes else None
    return torch.nested.nested_tensor_from_jagged(
        torch.cat([j.values for j in js], dim),
        torch.cat(offsets),
        lengths=None if lengths is None else torch.cat(lengths),
        jagged_dim=dim + 1,
    )


def _compressed_indices(t: Tensor) -> tuple[Tensor, Tensor]:
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


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
    if device.type == "cuda" and tensor.device.type == "cpu" and _strided(tensor):
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


# ---- rows ----------------------------------------------------------------------------------------


def _rows_text(leaf: Tensor | PerSample[Any]) -> str:
    if isinstance(leaf, PerSample):
        return f"{len(leaf.value)} rows (a PerSample of {len(leaf.value)} items)"
    shape = f"shape {tuple(leaf.shape)}" if not leaf.is_nested else describe(leaf)
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
    first_path, n = "", -1
    for path, leaf in counted:
        if isinstance(leaf, Tensor):
            check(path, leaf, api)
        m = leaf.size(0) if isinstance(leaf, Tensor) else len(leaf.value)
        if n < 0:
            first_path, n = path, m
        elif m != n:
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
    """The batch's rows ``n``: the shared, non-zero dim 0 of its tensor leaves and
    :class:`PerSample` values (messages start with ``api``).

    Raises:
        TypeError: no tensor (nor PerSample); a tensor whose rows cannot be cut; a container
            that cannot be rebuilt.
        ValueError: a 0-dim tensor leaf, leaves that disagree on dim 0, or 0 rows.
    """
    return _count_rows(flatten(batch, api)[0], api)


_How: TypeAlias = Literal["slice", "tensor", "rows", "whole"]


class RowSlicer:
    """Rows of one batch, moved to a device, many times: the batch is flattened once.

    ``RowSlicer(batch, device)(start, stop)`` is the batch with rows ``start:stop`` of every
    tensor leaf and per-sample sequence, its tensors moved to ``device`` (None: not moved) by
    :func:`move`. ``rows`` is the batch's ``n``; ``api`` starts error messages. Raises as
    :func:`batch_size` when built, and ``TypeError`` where torch cannot cut or move a leaf.
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
        self._build = functools.partial(pytree.tree_unflatten, treespec=spec)
        self.leaves = [(path, *self._plan(leaf)) for path, leaf in leaves]

    def _plan(self, leaf: Any) -> tuple[Any, _How]:
        if isinstance(leaf, Tensor):
            return leaf, "slice" if dense(leaf) else "tensor"
        if isinstance(leaf, PerSample) or (
            isinstance(leaf, Items) and len(leaf.value) == self.rows
        ):
            return leaf.value, "rows"
        return (leaf.value if isinstance(leaf, _Wrapped) else leaf), "whole"

    def __call__(self, start: int, stop: int) -> Batch:
        return self.cut(start, stop, self.device)

    def cut(
        self, start: int, stop: int, device: torch.device | None, columns: Any = None, k: int = 0
    ) -> Batch:
        """Rows ``start:stop`` with their tensors moved to ``device`` (None: not moved); a dense
        leaf ``i``'s rows are ``columns[i][k]`` where given (:meth:`split`)."""
        values = []
        for i, (path, leaf, how) in enumerate(self.leaves):
            if how == "slice":
                part = leaf[start:stop] if columns is None else columns[i][k]
                values.append(part if device is None else move(part, device))
            else:  # a helper: a generator here would make the loop's names slower cells
                values.append(self._leaf(path, leaf, how, start, stop, device))
        return self._build(values)

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
        op = functools.partial(cut, leaf, start, stop)
        part = guard(self.api, path, leaf, f"cut at rows {start}:{stop}", op)
        return part if device is None else self._move(path, part, device)

    def split(self, size: int) -> Iterator[tuple[Batch, int]]:
        """``(piece, rows)`` for rows ``0:size``, ``size:2*size``, ... (the last may be shorter),
        moved to the slicer's ``device``; every dense leaf is cut by one ``tensor_split``."""
        starts = range(0, self.rows, size)
        stops = [*starts[1:], self.rows]
        columns = [
            t.tensor_split(stops[:-1]) if how == "slice" else None for _, t, how in self.leaves
        ]
        if self.device is None and None not in columns:  # all dense, nothing to move
            pieces: Iterator[Batch] = map(self._build, zip(*columns))
        else:
            pieces = (
                self.cut(start, stop, self.device, columns, k)
                for k, (start, stop) in enumerate(zip(starts, stops))
            )
        return zip(pieces, (stop - start for start, stop in zip(starts, stops)))

    def shape_key(self) -> tuple[tuple[str, tuple[Any, ...], str], ...]:
        """Each tensor leaf's path, :func:`row_shape` and dtype: what the micro-batch size
        search keeps one ceiling for."""
        return tuple(
            (path, row_shape(leaf), str(leaf.dtype).removeprefix("torch."))
            for path, leaf, how in self.leaves
            if how in ("slice", "tensor")
        )

    def _move(self, path: str, x: Any, device: torch.device) -> Any:
        if not isinstance(x, Tensor):
            return x
        return guard(self.api, path, x, f"move to {device}", functools.partial(move, x, device))


# ---- joining pieces back -------------------------------------------------------------------------


def concat(
    pieces: Sequence[Batch], *, sizes: Sequence[int] | None = None, api: str = "MicroBatchRunner"
) -> Batch:
    """Join same-structured pieces (per-micro-batch outputs) along the rows, leaf by leaf, into
    the nesting of ``pieces[0]``.

    Tensors with a dim 0 and ``PerSample`` lists or tuples are concatenated; so is a tensor-free
    list or tuple whose length in every piece is that piece's rows (``sizes[k]``, else the dim
    0 its tensors agree on), unless every piece holds the same object. Anything else is taken
    from the first piece. Pieces whose tensor lists differ in length are nested differently.

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

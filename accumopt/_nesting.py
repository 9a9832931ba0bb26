"""Batch structure: which objects are containers, per-sample sequences or leaves (the rules in
:mod:`accumopt._tree`'s docstring), the :class:`PerSample` / :class:`Broadcast` markers, and
:func:`flatten`, which takes Mapping subclasses and dataclasses apart without registering them
with ``torch.utils._pytree`` (only this module's private ``_Node`` is registered)."""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from torch import Tensor
from torch.utils import _pytree as pytree

T = TypeVar("T")


class PerSample(Generic[T]):
    """Mark ``value`` as per-sample: each piece gets ``value[i:j]`` for its rows ``i:j``.

    For a sequence that the default rule would not cut: one that holds tensors (a list of
    ``n`` tensors of different lengths: each piece gets its own items, moved to the piece's
    device) or one that is not a list or tuple (a numpy array; pieces get ``value[i:j]``). It
    counts as ``n = len(value)`` rows, so a batch may consist of ``PerSample`` values only. A
    ``PerSample`` of a tensor is that tensor.

    Args:
        value: a list, tuple or other object with ``len()`` and slicing ``value[i:j]``.

    Raises:
        TypeError: ``value`` has no ``len()`` or no ``__getitem__``.

    Example:
        >>> import torch
        >>> from accumopt.split import PerSample, micro_split
        >>> boxes = PerSample([torch.zeros(1, 4), torch.zeros(3, 4), torch.zeros(0, 4)])
        >>> pieces = micro_split({"img": torch.zeros(3, 8), "boxes": boxes}, ["cpu", "cpu"])
        >>> [[b.shape[0] for b in p.batch["boxes"]] for p in pieces]
        [[1, 3], [0]]
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        if not (hasattr(value, "__len__") and hasattr(value, "__getitem__")):
            raise TypeError(
                f"PerSample: value={short(value)} has no len() or no slicing; expected a list, "
                "tuple or other sequence with one item per sample. Wrap such a value in "
                "Broadcast(...) to pass it whole, or leave it unwrapped."
            )
        self.value = value

    def __repr__(self) -> str:
        return f"PerSample({short(self.value)})"


class Broadcast(Generic[T]):
    """Mark ``value`` as per-batch: every piece gets ``value`` itself, uncut and unmoved.

    For a list or tuple whose length happens to equal the batch's rows (``image_size=(3, 224,
    224)`` in a batch of 3), or a tensor of per-batch constants (class weights): the value is
    neither walked, cut, moved nor counted as rows.

    Args:
        value: any object.

    Example:
        >>> import torch
        >>> from accumopt.split import Broadcast, micro_split
        >>> batch = {"x": torch.zeros(3, 2), "size": Broadcast((3, 224, 224))}
        >>> [p.batch["size"] for p in micro_split(batch, ["cpu", "cpu"])]
        [(3, 224, 224), (3, 224, 224)]
    """

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Broadcast({short(self.value)})"


def short(value: object) -> str:
    """``repr(value)``, shortened for error messages (a list of 4096 captions...)."""
    return reprlib.repr(value)


# ---- containers pytree does not know ----------------------------------------------------------


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
        if isinstance(self.original, Mapping):
            return pytree.MappingKey(name)
        return pytree.GetAttrKey(name)


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
    serialized_type_name="accumopt._nesting._Node",
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


class Items:
    """A list or tuple that holds no tensor, as one leaf of :func:`flatten`: ``value`` is the
    list or tuple itself (per-sample when its length is the batch's rows)."""

    __slots__ = ("value",)

    def __init__(self, value: list[Any] | tuple[Any, ...]) -> None:
        self.value = value


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
    """``([(path, leaf), ...], spec)``: the leaves by :mod:`accumopt._tree`'s rules, paths as
    in Python from ``root`` (``batch['x'][0]``). A tensor-free list or tuple is an
    :class:`Items` leaf, a marker is itself; ``pytree.tree_unflatten(values, spec)`` rebuilds
    the nesting (Mapping subclasses and dataclasses included) around the values put in their
    place (the list itself, or a cut of it, for an ``Items``).

    Raises:
        TypeError: a Mapping subclass or dataclass that cannot be rebuilt from its items
            (the message starts with ``api`` and names it).
    """
    prepared = _prepare(tree, (), api, root)
    flat, spec = pytree.tree_flatten_with_path(prepared, is_leaf=_is_wrapped)
    return [(root + pytree.keystr(path), leaf) for path, leaf in flat], spec


def _is_wrapped(x: object) -> bool:
    return isinstance(x, (PerSample, Broadcast, Items))

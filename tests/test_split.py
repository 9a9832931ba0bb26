"""micro_split: round-trip and size properties on random nestings, the error table, CUDA moves."""

from __future__ import annotations

import dataclasses
import doctest
from collections import UserDict
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import accumopt._tree
import accumopt.split
from accumopt.split import Piece, micro_split

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass
class Box:
    """A container torch's pytree does not know (as is ``UserDict``)."""

    first: Any
    second: Any


@st.composite
def nested_batches(draw: st.DrawFn) -> tuple[Any, int]:
    """A random dict/list/tuple/NamedTuple/UserDict/dataclass nesting with >= 1 tensor leaf of
    ``n`` rows, and lists of ``n`` captions."""
    n = draw(st.integers(1, 12))
    counter = iter(range(10**6))

    def tensor(trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # distinct values per leaf and row: a dropped or duplicated row cannot go unnoticed
        size = n * int(torch.Size(trailing).numel())
        values = torch.arange(size) + 1000 * next(counter)
        return values.reshape(n, *trailing).to(dtype)

    tensors = st.builds(
        tensor,
        st.lists(st.integers(0, 3), max_size=2).map(tuple),
        st.sampled_from([torch.float64, torch.int64, torch.float32, torch.bool]),
    )
    others = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(allow_nan=False))
    # a list of n captions: cut with the rows (shorter or longer lists arise from `tree` below)
    captions = st.lists(st.text(max_size=2), min_size=n, max_size=n)
    tree = st.recursive(
        st.one_of(tensors, others, captions),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.tuples(inner, inner),
            st.dictionaries(st.text("abxy", min_size=1, max_size=2), inner, max_size=3),
            st.builds(Pair, inner, inner),
            st.builds(Box, inner, inner),
            st.dictionaries(st.text("abxy", min_size=1, max_size=2), inner, max_size=3).map(
                UserDict
            ),
        ),
        max_leaves=8,
    )
    # the top level always carries one tensor leaf, wrapped in a random container kind
    batch = draw(
        st.one_of(
            tensors,
            st.builds(lambda t, rest: {"x": t, "rest": rest}, tensors, tree),
            st.builds(lambda t, rest: [rest, t], tensors, tree),
            st.builds(Pair, tree, tensors),
        )
    )
    return batch, n


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v) for v in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_holds_tensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return isinstance(obj, (list, tuple)) and any(_holds_tensor(v) for v in obj)


def expected_rows(obj: Any, i: int, j: int, n: int) -> Any:
    """Rows ``i:j`` of ``obj`` by the documented rules, written out without pytree: tensors and
    tensor-free lists/tuples of length ``n`` are cut, containers are rebuilt, the rest kept."""
    if isinstance(obj, torch.Tensor):
        return obj[i:j]
    if type(obj) in (list, tuple) and not _holds_tensor(obj):
        return obj[i:j] if len(obj) == n else obj
    if isinstance(obj, Mapping):
        return type(obj)({k: expected_rows(v, i, j, n) for k, v in obj.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        changes = {name: expected_rows(getattr(obj, name), i, j, n) for name in fields}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(expected_rows(v, i, j, n) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(expected_rows(v, i, j, n) for v in obj)
    return obj


def assert_same(actual: Any, expected: Any, device: torch.device) -> None:
    """Same nesting and container types, equal tensors (on ``device``), the same other objects."""
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.device == device and actual.dtype == expected.dtype
        assert actual.shape == expected.shape and torch.equal(actual.cpu(), expected.cpu())
    elif isinstance(expected, Mapping):
        assert list(actual) == list(expected)
        for k in expected:
            assert_same(actual[k], expected[k], device)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(actual, f.name), getattr(expected, f.name), device)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e, device)
    else:
        assert actual is expected


def _check_round_trip(batch: Any, pieces: list[Piece], devices: list[str], n: int) -> None:
    assert [p.device for p in pieces] == [torch.device(d) for d in devices]
    start = 0
    for piece in pieces:
        assert_same(piece.batch, expected_rows(batch, start, start + piece.size, n), piece.device)
        start += piece.size
    assert start == n


@settings(max_examples=150, deadline=None)
@given(case=nested_batches(), n_devices=st.integers(1, 4))
def test_pieces_concatenate_back_to_the_batch(case: tuple[Any, int], n_devices: int) -> None:
    batch, n = case
    n_devices = min(n_devices, n)
    devices = ["cpu"] * n_devices
    pieces = micro_split(batch, devices)
    _check_round_trip(batch, pieces, devices, n)
    sizes = [p.size for p in pieces]
    # sizes differ by at most one, the first pieces get the extra rows
    assert sizes == [n // n_devices + (k < n % n_devices) for k in range(n_devices)]


@settings(max_examples=150, deadline=None)
@given(
    case=nested_batches(),
    weights=st.lists(
        st.one_of(st.integers(1, 50), st.floats(1e-3, 1e3), st.fractions(Fraction(1, 7), 9)),
        min_size=1,
        max_size=4,
    ),
)
def test_weighted_sizes_follow_the_shares(case: tuple[Any, int], weights: list[Any]) -> None:
    batch, n = case
    weights = weights[:n]
    devices = ["cpu"] * len(weights)
    pieces = micro_split(batch, devices, weights=weights)
    _check_round_trip(batch, pieces, devices, n)
    exact = [Fraction(w) for w in weights]
    sizes = [p.size for p in pieces]
    assert sum(sizes) == n
    for size, w in zip(sizes, exact):
        assert abs(size - n * w / sum(exact)) < 1


def test_sizes_by_hand() -> None:
    x = torch.arange(10)
    assert [p.size for p in micro_split(x, ["cpu"] * 3)] == [4, 3, 3]
    assert [p.size for p in micro_split(x[:9], ["cpu", "cpu"], weights=[2, 1])] == [6, 3]
    # equal remainders: the earlier device gets the row
    assert [p.size for p in micro_split(x[:4], ["cpu"] * 3, weights=[1, 1, 1])] == [2, 1, 1]
    # a share that rounds to 0 rows gives an empty piece, not a lost row
    assert [p.size for p in micro_split(x, ["cpu"] * 3, weights=[1, 1000, 2])] == [0, 10, 0]
    assert micro_split(x, ["cpu"] * 3, weights=[1, 1000, 2])[0].batch.shape == (0,)


def test_cpu_pieces_are_views_of_the_batch() -> None:
    batch: dict[str, Any] = {"x": torch.randn(7, 2), "meta": {"epoch": 3, "ids": [torch.arange(7)]}}
    for piece in micro_split(batch, ["cpu", torch.device("cpu"), "cpu:0"]):
        x, ids = piece.batch["x"], piece.batch["meta"]["ids"][0]
        assert x.untyped_storage().data_ptr() == batch["x"].untyped_storage().data_ptr()
        assert (
            ids.untyped_storage().data_ptr() == batch["meta"]["ids"][0].untyped_storage().data_ptr()
        )
        assert piece.batch["meta"]["epoch"] == 3 and piece.device == torch.device("cpu")


def test_docstring_example_runs() -> None:
    assert doctest.testmod(accumopt.split, raise_on_error=True).attempted >= 1


def _cuda(count: int) -> Callable[[pytest.MonkeyPatch], None]:
    """Pretend to have ``count`` CUDA devices (or none) for the validation rows."""

    def setup(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return setup


def _nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pass


def _rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 2)


ERRORS: list[tuple[str, Callable[[], object], Any, type[Exception], str]] = [
    (
        "fewer rows than devices",
        lambda: micro_split({"x": _rows(2)}, ["cpu"] * 3),
        _nothing,
        ValueError,
        r"the batch has 2 rows for 3 devices; expected at least one row per device",
    ),
    (
        "empty batch",
        lambda: micro_split(_rows(0), ["cpu"]),
        _nothing,
        ValueError,
        r"micro_split: batch has 0 rows; expected a non-empty batch",
    ),
    (
        "mismatched lengths, nested path",
        lambda: micro_split({"x": _rows(4), "y": [_rows(4), _rows(3)]}, ["cpu"]),
        _nothing,
        ValueError,
        r"batch\['y'\]\[1\] has 3 rows along dim 0 \(shape \(3, 2\)\) but batch\['x'\] has 4; ",
    ),
    (
        "mismatched lengths, NamedTuple path",
        lambda: micro_split(Pair(_rows(4), _rows(5)), ["cpu"]),
        _nothing,
        ValueError,
        r"batch\.second has 5 rows",
    ),
    (
        "0-dim tensor leaf",
        lambda: micro_split([_rows(4), (_rows(4), torch.tensor(1.5))], ["cpu"]),
        _nothing,
        ValueError,
        r"batch\[1\]\[1\]=tensor\(1\.5\) is a 0-dim tensor; expected tensor leaves with a batch",
    ),
    (
        "no tensor leaf",
        lambda: micro_split({"a": 1, "b": "text"}, ["cpu"]),
        _nothing,
        TypeError,
        r"batch has no tensor leaf \(leaves: int, str\)",
    ),
    (
        "empty container",
        lambda: micro_split({}, ["cpu"]),
        _nothing,
        TypeError,
        r"no tensor leaf \(leaves: nothing\)",
    ),
    (
        "devices not a list",
        lambda: micro_split(_rows(4), "cpu"),  # a str is a Sequence: refused at runtime
        _nothing,
        TypeError,
        r"devices='cpu' is not a list; expected a list with one device per piece",
    ),
    (
        "no devices",
        lambda: micro_split(_rows(4), []),
        _nothing,
        ValueError,
        r"devices=\[\] is empty",
    ),
    (
        "unknown device string",
        lambda: micro_split(_rows(4), ["cpu", "gpu:0"]),
        _nothing,
        ValueError,
        r"devices\[1\]='gpu:0' is not a device; expected 'cpu', 'cuda'",
    ),
    (
        "unsupported device type",
        lambda: micro_split(_rows(4), ["meta"]),
        _nothing,
        ValueError,
        r"devices\[0\]='meta' has device type 'meta'; expected 'cpu' or 'cuda'",
    ),
    (
        "device of another type",
        lambda: micro_split(_rows(4), [1.5]),  # type: ignore[list-item]
        _nothing,
        TypeError,
        r"devices\[0\]=1\.5 is a float",
    ),
    (
        "bool device",
        lambda: micro_split(_rows(4), [True]),
        _nothing,
        TypeError,
        r"devices\[0\]=True is a bool",
    ),
    (
        "negative CUDA index",
        lambda: micro_split(_rows(4), [-1]),
        _nothing,
        ValueError,
        r"devices\[0\]=-1 is negative",
    ),
    (
        "CUDA string without CUDA",
        lambda: micro_split(_rows(4), ["cpu", "cuda:0"]),
        _cuda(0),
        ValueError,
        r"devices\[1\]='cuda:0' is a CUDA device but CUDA is not available",
    ),
    (
        "CUDA index without CUDA",
        lambda: micro_split(_rows(4), [0]),
        _cuda(0),
        ValueError,
        r"devices\[0\]=0 is a CUDA device but CUDA is not available",
    ),
    (
        "CUDA index out of range",
        lambda: micro_split(_rows(4), [torch.device("cuda", 0), "cuda:2"]),
        _cuda(2),
        ValueError,
        r"devices\[1\]='cuda:2' is out of range; expected a CUDA index below "
        r"torch\.cuda\.device_count\(\)=2",
    ),
    (
        "weights wrong length",
        lambda: micro_split(_rows(4), ["cpu", "cpu"], weights=[1.0]),
        _nothing,
        ValueError,
        r"weights=\[1\.0\] has 1 entries for 2 devices",
    ),
    (
        "weight zero",
        lambda: micro_split(_rows(4), ["cpu", "cpu"], weights=[1, 0]),
        _nothing,
        ValueError,
        r"weights=\[1, 0\] has the entry 0; expected positive finite",
    ),
    (
        "weight negative",
        lambda: micro_split(_rows(4), ["cpu", "cpu"], weights=[-1, 2]),
        _nothing,
        ValueError,
        r"has the entry -1",
    ),
    (
        "weight nan",
        lambda: micro_split(_rows(4), ["cpu", "cpu"], weights=[1, float("nan")]),
        _nothing,
        ValueError,
        r"has the entry nan",
    ),
    (
        "weight inf",
        lambda: micro_split(_rows(4), ["cpu", "cpu"], weights=[float("inf"), 1]),
        _nothing,
        ValueError,
        r"has the entry inf",
    ),
    (
        "weight bool",
        lambda: micro_split(_rows(4), ["cpu", "cpu"], weights=[True, 1]),
        _nothing,
        ValueError,
        r"has the entry True",
    ),
    (
        "weights a tensor",
        lambda: micro_split(_rows(4), ["cpu", "cpu"], weights=torch.ones(2)),  # type: ignore[arg-type]
        _nothing,
        TypeError,
        r"weights=tensor\(.*\) is not a list",
    ),
]


@pytest.mark.parametrize(
    ("call", "setup", "exc", "match"),
    [row[1:] for row in ERRORS],
    ids=[row[0] for row in ERRORS],
)
def test_errors(
    call: Callable[[], object],
    setup: Callable[[pytest.MonkeyPatch], None],
    exc: type[Exception],
    match: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup(monkeypatch)
    with pytest.raises(exc, match=match):
        call()


def test_int_device_is_a_cuda_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """An int parses as a CUDA index (checked without touching CUDA: the move is stubbed)."""
    _cuda(2)(monkeypatch)
    moved: list[torch.device] = []

    def record(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        moved.append(device)
        return t

    monkeypatch.setattr(accumopt._tree, "move", record)
    pieces = micro_split(_rows(4), [1, "cuda:0", torch.device("cuda", 1)])
    assert [p.device for p in pieces] == [torch.device("cuda", i) for i in (1, 0, 1)]
    assert moved == [p.device for p in pieces]


@CUDA
def test_cuda_pieces_land_on_their_device() -> None:
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu"]
    batch = {"x": torch.randn(11, 3), "y": [torch.arange(11).cuda()], "tag": "t"}
    pieces = micro_split(batch, devices)
    torch.cuda.synchronize()
    _check_round_trip(batch, pieces, devices, 11)
    for piece in pieces:
        assert piece.batch["x"].device == piece.device == piece.batch["y"][0].device

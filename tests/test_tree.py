"""RowSlicer's cheap path for the usual batch and its split(): the same leaves, paths, keys and
pieces as the general (pytree) path, with no pytree round trip; the runner on top of it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_split import assert_same, expected_rows, nested_batches

import accumopt._tree
from accumopt import Accumulate, MicroBatchRunner
from accumopt._tree import RowSlicer
from accumopt.split import Broadcast, PerSample

CPU = torch.device("cpu")


class Pair(NamedTuple):
    x: Any
    y: Any


def _general(batch: Any, monkeypatch: pytest.MonkeyPatch, device: torch.device | None = None):
    """A slicer built by the general (pytree) path, whatever the batch."""
    with monkeypatch.context() as m:
        m.setattr(accumopt._tree, "plain", lambda batch: None)
        return RowSlicer(batch, device)


@st.composite
def plain_batches(draw: st.DrawFn) -> tuple[Any, int]:
    """A tensor, or a tuple, list or dict of 1-4 tensors of ``n`` rows (any trailing shape,
    several dtypes, some non-contiguous)."""
    n = draw(st.integers(1, 40))

    def leaf(k: int) -> torch.Tensor:
        trailing = draw(st.lists(st.integers(1, 3), max_size=2))
        dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.int64, torch.bool]))
        t = (torch.arange(n * int(torch.Size(trailing).numel())) + 1000 * k).to(dtype)
        t = t.reshape(n, *trailing)
        return t.transpose(0, -1).contiguous().transpose(0, -1) if draw(st.booleans()) else t

    count = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["tensor", "tuple", "list", "dict"]))
    if kind == "tensor":
        return leaf(0), n
    leaves = [leaf(k) for k in range(count)]
    if kind == "dict":
        keys = draw(
            st.lists(
                st.one_of(st.text("abxy", min_size=1), st.integers()),
                min_size=count,
                max_size=count,
                unique=True,
            )
        )
        return dict(zip(keys, leaves)), n
    return (tuple if kind == "tuple" else list)(leaves), n


def _same_views(actual: Any, expected: Any) -> None:
    """The same nesting, and tensors that are the same view of the same storage."""
    assert_same(actual, expected, CPU)
    flat_a, flat_e = (accumopt._tree.flatten(tree, "t")[0] for tree in (actual, expected))
    for (_, a), (_, e) in zip(flat_a, flat_e):
        if isinstance(e, torch.Tensor):
            assert a.untyped_storage().data_ptr() == e.untyped_storage().data_ptr()
            assert (a.storage_offset(), a.stride()) == (e.storage_offset(), e.stride())


@settings(max_examples=100, deadline=None)
@given(case=plain_batches(), size=st.integers(1, 45))
def test_plain_batches_match_the_general_path(case: tuple[Any, int], size: int) -> None:
    batch, n = case
    with pytest.MonkeyPatch.context() as monkeypatch:
        general = _general(batch, monkeypatch)
    fast = RowSlicer(batch, None)
    assert fast.rows == general.rows == n
    assert fast.shape_key() == general.shape_key()
    assert [(p, how) for p, _, how in fast.leaves] == [(p, how) for p, _, how in general.leaves]
    pieces = list(fast.split(size))
    assert [rows for _, rows in pieces] == [min(size, n - s) for s in range(0, n, size)]
    for (piece, rows), start in zip(pieces, range(0, n, size)):
        _same_views(piece, general(start, start + rows))
        _same_views(fast(start, start + rows), piece)


@settings(max_examples=60, deadline=None)
@given(case=nested_batches(), size=st.integers(1, 13), move=st.booleans())
def test_split_gives_the_pieces_cut_gives(case: tuple[Any, int], size: int, move: bool) -> None:
    batch, n = case
    slicer = RowSlicer(batch, CPU if move else None)
    start = 0
    for piece, rows in slicer.split(size):
        assert rows == min(size, n - start)
        assert_same(piece, expected_rows(batch, start, start + rows, n), CPU)
        start += rows
    assert start == n


def test_the_usual_batch_takes_no_pytree_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("flattened through pytree")

    monkeypatch.setattr(accumopt._tree, "flatten", refuse)
    monkeypatch.setattr(torch.utils._pytree, "tree_unflatten", refuse)
    x, y = torch.randn(10, 3), torch.randn(10)
    for batch in (x, (x, y), [x, y], {"x": x, 2: y}):
        slicer = RowSlicer(batch, None)
        assert slicer.rows == 10
        assert len(list(slicer.split(4))) == 3 and type(slicer(0, 3)) is type(batch)
    # anything else takes the general path
    others = [
        Pair(x, y),
        OrderedDict(x=x),
        (x, [x]),
        (x, "tag"),
        {"x": x, "ids": list(range(10))},
        torch.nn.Parameter(x),
        (x, torch.tensor(1.0)),
    ]
    for batch in others:
        with pytest.raises(AssertionError, match="flattened through pytree"):
            RowSlicer(batch, None)


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ((), TypeError, "batch has no tensor leaf"),
        ({"x": torch.zeros(0, 2)}, ValueError, r"batch\['x'\] has 0 rows"),
        (
            (torch.zeros(3), torch.zeros(2)),
            ValueError,
            r"batch\[1\] has 2 rows .* batch\[0\] has 3",
        ),
        ([torch.zeros(3), torch.tensor(1.0)], ValueError, r"batch\[1\]=tensor\(1.0\) is a 0-dim"),
        (torch.tensor(2.0), ValueError, r"batch=tensor\(2.0\) is a 0-dim"),
    ],
)
def test_a_bad_plain_batch_gets_the_general_message(batch: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RowSlicer(batch, None)


def test_markers_and_special_kinds_split_like_cut() -> None:
    n = 5
    batch = {
        "x": torch.arange(10.0).reshape(n, 2),
        "sparse": torch.eye(n).to_sparse(),
        "boxes": PerSample([torch.zeros(k, 4) for k in range(n)]),
        "scale": Broadcast(torch.ones(3)),
        "ids": list("abcde"),
    }
    slicer = RowSlicer(batch, CPU)
    for (piece, rows), start in zip(slicer.split(2), (0, 2, 4)):
        expected = slicer(start, start + rows)
        assert piece["scale"] is batch["scale"].value and piece["ids"] == expected["ids"]
        assert torch.equal(piece["x"], expected["x"])
        assert torch.equal(piece["sparse"].to_dense(), expected["sparse"].to_dense())
        assert [b.shape for b in piece["boxes"]] == [b.shape for b in expected["boxes"]]


def test_pieces_of_inputs_that_require_grad_are_slices() -> None:
    # rows cut as leaf[i:j] (SliceBackward0, unlike torch.split's multi-output views, which
    # refuse in-place changes); the gradient reaches every row of the input exactly once
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(12, 3, requires_grad=True), torch.randn(12, 1)
    assert all(
        type(p[0].grad_fn).__name__ == "SliceBackward0" for p, _ in RowSlicer((x, y), None).split(5)
    )
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.0), every_items=12)

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ((model(batch[0]) - batch[1]) ** 2).sum()

    MicroBatchRunner(acc, loss_fn, micro_batch_size=5, loss_reduction="sum")((x, y))
    (expected,) = torch.autograd.grad(loss_fn((x, y)), x)
    assert x.grad is not None and torch.equal(x.grad, expected)

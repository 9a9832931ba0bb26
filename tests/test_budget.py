"""The token-budget planner (``accumopt/budget.py``) on host data, without a model: every row in
exactly one micro-batch, within the budget, in few shapes, as many micro-batches on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accumopt import TokenBudget
from accumopt.budget import Cut, Tally, padded_leaves, plan, read_counts, window_end

BUCKETS = st.sampled_from(["pow2", None, (4, 8, 16, 64)])


def run(spec: TokenBudget, ranks: list[tuple[list[int], int | None]], budget: int) -> list[Any]:
    """Every rank's cuts of one window holding all rows, in the order they run."""
    p, cuts = plan(spec, ranks, lambda start: (len(ranks[0][0]), False)), []
    while p.ready():
        cuts.append(p.next(budget))
        p.advance()
    return [[step[rank] for step in cuts] for rank in range(len(ranks))]


def spec_of(padded: bool, sort: bool, buckets: Any) -> TokenBudget:
    return TokenBudget(1, cost=len, padded=padded, sort=sort, buckets=buckets)


def check_cuts(
    cuts: Sequence[Cut], costs: list[int], cap: int | None, budget: int, spec: Any
) -> None:
    rows = [r for cut in cuts for r in cut.rows]
    assert sorted(rows) == list(range(len(costs)))  # each row exactly once
    if not spec.sort:
        assert rows == list(range(len(costs)))  # contiguous, in order
    for cut in cuts:
        own = [max(1, costs[r]) for r in cut.rows]
        assert cut.cost <= budget or len(cut.rows) == 1
        if spec.buckets is not None:
            assert len(cut.rows) & (len(cut.rows) - 1) == 0  # a power of two
        if not spec.padded:
            assert cut.length is None and cut.cost == sum(own)
            continue
        assert cut.length is not None and cut.cost == len(cut.rows) * cut.length
        assert cut.length >= max(own) or cut.length == cap
        assert cap is None or cut.length <= cap
        if spec.buckets == "pow2" and cut.length != cap:
            assert cut.length & (cut.length - 1) == 0


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(0, 50), min_size=1, max_size=40),
    budget=st.integers(1, 300),
    padded=st.booleans(),
    sort=st.booleans(),
    buckets=BUCKETS,
    capped=st.booleans(),
)
def test_every_row_runs_once_within_the_budget(
    costs: list[int], budget: int, padded: bool, sort: bool, buckets: Any, capped: bool
) -> None:
    spec = spec_of(padded, sort, buckets)
    cap = max(max(costs), 1) if capped else None
    (cuts,) = run(spec, [(costs, cap)], budget)
    check_cuts(cuts, costs, cap, budget, spec)
    if sort:  # longest first (a row costs at least 1)
        firsts = [max(max(1, costs[r]) for r in cut.rows) for cut in cuts]
        assert firsts == sorted(firsts, reverse=True)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 30),
    ranks=st.integers(2, 3),
    data=st.data(),
    padded=st.booleans(),
    sort=st.booleans(),
    buckets=BUCKETS,
)
def test_every_rank_runs_as_many_micro_batches(
    rows: int, ranks: int, data: st.DataObject, padded: bool, sort: bool, buckets: Any
) -> None:
    """Each rank's own rows (of its own lengths), one window: the same number of cuts on every
    rank, each rank's rows once, within the budget; the rank that needs most keeps its cuts."""
    spec, budget = spec_of(padded, sort, buckets), data.draw(st.integers(1, 200))
    counts = [(data.draw(st.lists(st.integers(1, 40), min_size=rows, max_size=rows)), None)]
    counts += [
        (data.draw(st.lists(st.integers(1, 40), min_size=rows, max_size=rows)), None)
        for _ in range(ranks - 1)
    ]
    plans = run(spec, counts, budget)
    alone = [len(run(spec, [c], budget)[0]) for c in counts]
    assert {len(p) for p in plans} == {max(alone)}
    for cuts, (costs, cap) in zip(plans, counts):
        check_cuts(cuts, costs, cap, budget, spec)


def test_a_new_budget_plans_the_rest_of_the_window_again() -> None:
    """The "auto" search changes the budget between micro-batches: the rows not run yet are cut
    again under the new one, those that ran stay run."""
    p = plan(spec_of(False, False, None), [([4] * 8, None)], lambda start: (8, True))
    assert p.ready() and p.available() == 32
    assert list(p.next(16)[0].rows) == [0, 1, 2, 3] and not p.closes
    p.advance()
    assert p.available() == 16
    assert list(p.next(8)[0].rows) == [4, 5] and not p.closes
    p.advance()
    assert list(p.next(8)[0].rows) == [6, 7] and p.closes
    p.advance()
    assert not p.ready()


def test_windows_open_where_the_last_ended_and_the_rows_sort_within_them() -> None:
    asked: list[int] = []

    def ends(start: int) -> tuple[int, bool]:
        asked.append(start)
        return window_end([1] * 6, start, 3)

    spec = TokenBudget(1, cost=len, padded=True, sort=True, buckets=None)
    p, ran = plan(spec, [([1, 2, 3, 6, 5, 4], None)], ends), []
    while p.ready():
        ran.append((list(p.next(5)[0].rows), p.closes))
        p.advance()
    assert asked == [0, 3]
    assert ran == [([2], False), ([1, 0], True), ([3], False), ([4], False), ([5], True)]


def test_a_window_in_items_keeps_its_last_row_last_when_sorted() -> None:
    """The row whose items reach the window's total runs in its last micro-batch (the wrapper
    closes on the total); a window that does not end here is sorted whole."""
    spec = TokenBudget(1, cost=len, padded=True, sort=True, buckets=None)
    costs = [1, 2, 9, 3, 4, 8]
    p, ran = (
        plan(spec, [(costs, None)], lambda start: (3, True) if start == 0 else (6, False), True),
        [],
    )
    while p.ready():
        ran.append(list(p.next(1)[0].rows))
        p.advance()
    assert ran == [[1], [0], [2], [5], [4], [3]]


@pytest.mark.parametrize(
    ("weights", "start", "needed", "end"),
    [
        ([1, 1, 1], 0, 2, (2, True)),
        ([1, 1, 1], 0, 3, (3, True)),
        ([1, 1, 1], 0, 4, (3, False)),
        ([5, 0, 7], 0, 5, (1, True)),  # a row of no items after the end starts the next window
        ([5, 0, 7], 1, 6, (3, True)),
        ([2, 3], 0, float("inf"), (2, False)),
    ],
)
def test_window_end(weights: list[int], start: int, needed: float, end: tuple[int, bool]) -> None:
    assert window_end(weights, start, needed) == end


def test_padded_leaves_are_the_dense_ones_as_long_as_the_longest_dim_1() -> None:
    leaves = [
        ("batch['ids']", torch.zeros(4, 16), "slice"),
        ("batch['labels']", torch.zeros(4, 16, dtype=torch.long), "slice"),
        ("batch['lengths']", torch.zeros(4), "slice"),
        ("batch['feature']", torch.zeros(4, 3), "slice"),
        ("batch['nested']", torch.zeros(4, 16), "tensor"),
        ("batch['names']", ["a", "b", "c", "d"], "rows"),
    ]
    assert padded_leaves(leaves, 12) == (16, [0, 1])
    assert padded_leaves(leaves[2:3], 12) == (None, [])
    with pytest.raises(ValueError, match=r"a row costs 17, more than the batch's padded length 16"):
        padded_leaves(leaves, 17)


@pytest.mark.parametrize(
    ("values", "exc", "pattern"),
    [
        (torch.tensor([1.0, 2.0, 3.0]), ValueError, r"gave tensor\(\[1\., 2.*int >= 0 per row"),
        (torch.tensor([[1, 2, 3]]), ValueError, r"gave .* \(shape \(1, 3\)\)"),
        (
            torch.tensor([1, 2]),
            ValueError,
            r"gave .*; expected one int >= 0 per row of the batch \(3",
        ),
        ([1, -2, 3], ValueError, r"gave \[1, -2, 3\]"),
        ([1, 2.5, 3], ValueError, r"gave \[1, 2\.5, 3\]"),
        ("abc", TypeError, r"gave a str; expected a 1-D integer tensor"),
        (None, TypeError, r"gave a NoneType"),
    ],
)
def test_bad_counts_are_refused(values: Any, exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=r"^MicroBatchRunner: TokenBudget cost\(batch\) " + pattern):
        read_counts(values, 3, "cost")


def test_counts_are_read_as_ints() -> None:
    assert read_counts(torch.tensor([3, 0, 2]), 3, "items") == [3, 0, 2]
    assert read_counts((1, 2, 3), 3, "items") == [1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"tokens": 0}, ValueError, r"tokens=0 is not an int >= 1 or 'auto'"),
        ({"tokens": "big"}, ValueError, r"tokens='big'"),
        ({"cost": [1, 2]}, TypeError, r"cost=\[1, 2\] is not callable; expected cost\(batch\)"),
        ({"items": 3}, TypeError, r"items=3 is not callable or None"),
        ({"padded": None}, TypeError, r"padded=None is not a bool"),
        ({"sort": 1}, TypeError, r"sort=1 is not a bool"),
        ({"rows_per_update": 0}, ValueError, r"rows_per_update=0 is not an int >= 1 or None"),
        ({"buckets": "pow3"}, ValueError, r"buckets='pow3'; expected 'pow2', None, or"),
        ({"buckets": [8, 0]}, ValueError, r"buckets=\[8, 0\]"),
        ({"buckets": []}, ValueError, r"buckets=\[\]"),
        ({"trim": "ids"}, ValueError, r"trim='ids' \(padded=True\); expected a sequence"),
        ({"trim": ()}, ValueError, r"trim=\(\) \(padded=True\)"),
        ({"trim": ("ids",), "padded": False}, ValueError, r"trim=\('ids',\) \(padded=False\)"),
    ],
)
def test_bad_budgets_are_refused(
    kwargs: dict[str, Any], exc: type[Exception], pattern: str
) -> None:
    given = {"tokens": 64, "cost": len, "padded": True, **kwargs}
    with pytest.raises(exc, match=r"^TokenBudget: " + pattern):
        TokenBudget(**given)


def test_an_unclear_padded_length_is_refused_and_trim_names_the_padded_leaves() -> None:
    """A per-row feature wider than the sequences would be taken for the padded leaf (and cut)
    with ids left whole: refused, unless trim= names the padded leaves."""
    leaves = [
        ("batch['ids']", torch.zeros(4, 128), "slice"),
        ("batch['labels']", torch.zeros(4, 128), "slice"),
        ("batch['feature']", torch.zeros(4, 512), "slice"),
        ("batch['small']", torch.zeros(4, 3), "slice"),
        ("batch.mask", torch.zeros(4, 128), "slice"),
        ("batch[2]", torch.zeros(4, 128), "slice"),
        ("batch['ctx']['ids']", torch.zeros(4, 128), "slice"),
        ("batch[3][2]", torch.zeros(4, 128), "slice"),
    ]
    with pytest.raises(ValueError, match=r"batch\['ids'\] has dim 1 of 128, as long as the "):
        padded_leaves(leaves, 100)
    # a name is the batch's own leaf, never one of that name nested deeper
    assert padded_leaves(leaves, 100, ("ids", "labels", "mask", 2)) == (128, [0, 1, 4, 5])
    assert padded_leaves(leaves, 2, ("small",)) == (3, [3])
    for trim in (("nothing",), ("ids", "feature")):
        with pytest.raises(ValueError, match=r"TokenBudget\(trim=.*expected one or more, all"):
            padded_leaves(leaves, 100, trim)
    with pytest.raises(ValueError, match=r"a row costs 200, more than the batch's padded"):
        padded_leaves(leaves, 200, ("ids",))


def test_bucket_lists_are_sorted_once() -> None:
    assert TokenBudget(8, cost=len, padded=True, buckets=[64, 16, 16]).buckets == (16, 64)


def test_the_tally_counts_padding_failures_and_shapes() -> None:
    tally = Tally()
    assert tally.padding == 0.0
    tally.ran(Cut(range(0, 2), 8, 16), [5, 7])
    tally.ran(Cut([2], 4, 4), [5, 7, 4])
    tally.lost(Cut(range(0, 3), 8, 24))
    assert (tally.micro_batches, tally.rows, tally.tokens, tally.computed) == (2, 3, 16, 20)
    assert (tally.failed, tally.wasted, tally.shapes) == (1, 24, {(2, 8), (1, 4)})
    assert tally.padding == pytest.approx(0.2)

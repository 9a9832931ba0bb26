"""The accumulation window on its own: sequences of events against a tiny reference model of
the rules (pure Python, no tensors)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accumopt._window import Window


class Reference:
    """The rules, written as plainly as possible: a window is the list of its micro-steps'
    item counts (None for unweighted ones)."""

    def __init__(self, every: int | None, every_items: float | None, reduction: str) -> None:
        self.every, self.every_items, self.reduction = every, every_items, reduction
        self.steps: list[float | None] = []

    def closed(self) -> bool:
        if self.every is not None:
            return len(self.steps) >= self.every
        assert self.every_items is not None
        return sum(i for i in self.steps if i is not None) >= self.every_items

    def refuses(self, items: float | None) -> type[Exception] | None:
        if self.steps and self.closed():
            return RuntimeError
        if self.every_items is not None and items is None:
            return ValueError
        if self.steps and (self.steps[0] is None) != (items is None):
            return ValueError
        return None

    def divisor(self, world: int) -> float | None:
        if self.reduction == "sum":
            return 1.0
        if self.steps and self.steps[0] is not None:
            total = sum(i for i in self.steps if i is not None)
            return total if total > 0 else None
        return float(len(self.steps) * world)


window_settings = st.one_of(
    st.tuples(st.integers(1, 6), st.none()),
    st.tuples(st.none(), st.sampled_from([0.5, 1.0, 3.0, 7.5, 20.0])),
)
events = st.lists(
    st.one_of(
        st.none(),  # an unweighted micro-step
        st.sampled_from([0.0, 1.0, 2.0, 3.5, 8.0]),  # a weighted one
        st.just("reset"),  # step() at the boundary, flush() or discard()
    ),
    max_size=40,
)


@given(window_settings, st.sampled_from(["mean", "sum"]), st.integers(1, 4), events)
def test_window_follows_the_reference_rules(
    setting: tuple[int | None, float | None], reduction: str, world: int, sequence: list[object]
) -> None:
    every, every_items = setting
    window, ref = Window(every, every_items, reduction), Reference(every, every_items, reduction)
    for event in sequence:
        if event == "reset":
            window.reset()
            ref.steps = []
            continue
        items = None if event is None else float(event)  # type: ignore[arg-type]
        refusal = window.refusal(items is not None)
        expected = ref.refuses(items)
        assert (refusal[0] if refusal else None) is expected
        if refusal is not None:
            assert refusal[1].startswith("Accumulate: ") and "expected" in refusal[1]
            continue
        closes = window.count(items)
        ref.steps.append(items)
        assert closes == ref.closed() == window.closed == window.full()
        assert window.micro_step == len(ref.steps)
        assert window.items == sum(i for i in ref.steps if i is not None)
        assert window.weighted == (items is not None)
        assert window.divisor(world) == ref.divisor(world)
        assert window.next_closes() == (every is not None and len(ref.steps) + 1 >= every)


@given(window_settings, events)
def test_window_position_round_trips(
    setting: tuple[int | None, float | None], sequence: list[object]
) -> None:
    window = Window(*setting, "mean")
    for event in sequence:
        if event == "reset":
            continue
        items = None if event is None else float(event)  # type: ignore[arg-type]
        if window.refusal(items is not None) is None:
            window.count(items)
    copy = Window(*setting, "mean")
    copy.restore(window.position())
    assert copy.position() == window.position()
    assert copy.divisor(2) == window.divisor(2)


def test_an_empty_weighted_window_is_skipped_not_divided_by_zero() -> None:
    window = Window(2, None, "mean")
    window.count(0.0)
    assert window.count(0.0)
    assert window.divisor() is None


@pytest.mark.parametrize("every", [1, 3])
def test_a_closed_window_refuses_the_next_micro_step_until_reset(every: int) -> None:
    window = Window(every, None, "mean")
    while not window.closed:
        window.count(None)
    refusal = window.refusal(False)
    assert refusal is not None and refusal[0] is RuntimeError
    assert "step()" in refusal[1]
    window.reset()
    assert window.refusal(False) is None


@given(
    st.booleans(),
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.integers(1, 3),
    events,
)
def test_a_scheduled_window_follows_the_reference_rules(
    in_items: bool, sizes: list[int], world: int, sequence: list[object]
) -> None:
    """With a schedule, each window is sized when it opens, from the updates applied and their
    items; inside it, the rules are those of a fixed window of that size."""

    def schedule(updates: int, seen: float) -> float:
        return sizes[(updates + int(seen)) % len(sizes)] * (1.5 if in_items else 1)

    every, every_items = (None, schedule) if in_items else (schedule, None)
    window = Window(every, every_items, "mean")
    updates, seen = 0, 0.0
    ref = Reference(*((None, schedule(0, 0.0)) if in_items else (schedule(0, 0.0), None)), "mean")
    for event in sequence:
        if event == "reset":
            if window.closed:  # the update was applied: the schedule moves on
                assert window.applied(updates) == updates + 1
                updates, seen = updates + 1, seen + sum(i for i in ref.steps if i is not None)
            window.reset()
            size = schedule(updates, seen)
            ref = Reference(*((None, size) if in_items else (int(size), None)), "mean")
            assert (window.every_items if in_items else window.every) == size
            assert (window.updates, window.items_seen) == (updates, seen)
            continue
        items = None if event is None else float(event)  # type: ignore[arg-type]
        refusal = window.refusal(items is not None)
        assert (refusal[0] if refusal else None) is ref.refuses(items)
        if refusal is not None:
            continue
        closes = window.count(items)
        ref.steps.append(items)
        assert closes == ref.closed() == window.closed
        assert window.divisor(world) == ref.divisor(world)
        assert window.next_closes() == (not in_items and len(ref.steps) + 1 >= ref.every)  # type: ignore[operator]


def test_a_schedule_s_bad_size_is_refused_until_it_gives_a_good_one() -> None:
    sizes = [2, 0]
    window = Window(lambda updates, seen: sizes[min(updates, 1)], None, "mean")
    window.count(None)
    window.count(None)
    window.applied(0)
    opened = []
    with pytest.raises(ValueError, match=r"update 2 .*whole number of micro-steps"):
        window.reset(opened=lambda: opened.append(window.micro_step))
    assert opened == [0] and window.micro_step == 0
    refusal = window.refusal(False)
    assert refusal is not None and refusal[0] is ValueError and "update 2" in refusal[1]
    sizes[1] = 3
    assert window.refusal(False) is None and window.every == 3

"""Window schedules for ``every=`` (micro-steps) or ``every_items=`` (items): any callable
``f(updates, items_seen) -> size``, asked when a window opens (docs/guide/schedules.md)."""

from __future__ import annotations

import bisect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_Fn = Callable[[int, float], Any]


def _real(api: str, name: str, value: object, kind: type = numbers.Real) -> Any:
    """``value`` if a finite real number (an int with ``kind=int``), else TypeError/ValueError
    naming ``api`` and ``name`` (a bool or a numeric string is not taken as a number)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        expected = "an int" if kind is int else "a finite real number"
        raise TypeError(
            f"{api}: {name}={value!r} is a {type(value).__qualname__}; expected {expected}."
        )
    if not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"{api}: {name}={value!r} is not finite; expected a finite real number.")
    return value


class Schedule:
    """``fn(updates, items_seen) -> size``; the wrapper refuses a size outside ``[minimum,
    maximum]`` (None: unbounded). Subclasses override :meth:`size` instead of giving ``fn``."""

    def __init__(
        self, fn: _Fn | None = None, *, minimum: float | None = None, maximum: float | None = None
    ) -> None:
        self.fn, self.minimum, self.maximum = fn, minimum, maximum

    def __call__(self, updates: int, items_seen: float) -> Any:
        return self.size(updates, items_seen)

    def size(self, updates: int, items_seen: float) -> Any:
        """The size of the window that opens after ``updates`` updates of ``items_seen``."""
        if self.fn is None:
            raise NotImplementedError("Schedule: give fn, or override size()")
        return self.fn(updates, items_seen)

    def __repr__(self) -> str:
        return f"Schedule({self.fn!r}, minimum={self.minimum!r}, maximum={self.maximum!r})"


class LinearRamp(Schedule):
    """From ``start`` to ``end`` (micro-steps, or items with ``every_items=``) over
    ``over_updates`` updates or ``over_items`` items seen, in steps of ``increment`` each held
    for an equal share of the ramp (Megatron-LM's ``--rampup-batch-size``), then ``end``.
    ValueError: not exactly one of ``over_updates``/``over_items``, or a value <= 0."""

    def __init__(
        self,
        start: float,
        end: float,
        *,
        over_updates: int | None = None,
        over_items: float | None = None,
        increment: float = 1,
    ) -> None:
        if (over_updates is None) == (over_items is None):
            raise ValueError(
                f"LinearRamp: got over_updates={over_updates!r} and over_items={over_items!r}; "
                "expected exactly one, > 0 (how long the ramp lasts)."
            )
        for name, value in [("start", start), ("end", end), ("increment", increment)]:
            _real("LinearRamp", name, value)
        given = (
            ("over_updates", over_updates)
            if over_updates is not None
            else ("over_items", over_items)
        )
        over = float(_real("LinearRamp", *given))
        if not (over > 0 and start > 0 and end > 0 and increment > 0):
            values = f"start={start!r}, end={end!r}, increment={increment!r}, over={over!r}"
            raise ValueError(f"LinearRamp: {values}; expected all > 0.")
        super().__init__(minimum=min(start, end), maximum=max(start, end))
        self.start, self.end, self.increment, self.over = start, end, increment, over
        self.by = "updates" if over_updates is not None else "items"

    def size(self, updates: int, items_seen: float) -> Any:
        done = (updates if self.by == "updates" else items_seen) / self.over
        if done >= 1.0:
            return self.end
        span = self.end - self.start
        steps = math.floor(abs(span) / self.increment * done + 1e-9)
        return self.start + math.copysign(steps * self.increment, span)

    def __repr__(self) -> str:
        over = f"over_{self.by}={self.over:g}"
        return f"LinearRamp({self.start!r}, {self.end!r}, {over}, increment={self.increment!r})"


class StepSchedule(Schedule):
    """Piecewise constant: from each ``(threshold, size)`` of ``steps`` on (thresholds in items
    seen, or updates with ``by="updates"``, increasing from 0) the window is ``size /
    per_micro_step``: with ``every=``, the items of one micro-step over all ranks, the sizes
    being batch sizes in items; 1 with ``every_items=``. ValueError for bad arguments."""

    def __init__(
        self, steps: Sequence[tuple[float, float]], *, by: str = "items", per_micro_step: float = 1
    ) -> None:
        if by not in ("items", "updates"):
            raise ValueError(f"StepSchedule: by={by!r}; expected 'items' or 'updates'.")
        if not _real("StepSchedule", "per_micro_step", per_micro_step) > 0:
            raise ValueError(f"StepSchedule: per_micro_step={per_micro_step!r}; expected > 0.")
        if isinstance(steps, str | bytes) or not all(
            isinstance(step, Sequence) and len(step) == 2 for step in steps
        ):
            raise TypeError(
                f"StepSchedule: steps={steps!r}; expected (threshold, size) pairs, e.g. "
                "[(0, 768), (250e9, 1536)] (StepSchedule.parse reads them from a string)."
            )
        steps = [
            (float(_real("StepSchedule", "threshold", t)), float(_real("StepSchedule", "size", v)))
            for t, v in steps
        ]
        thresholds = [t for t, _ in steps]
        if not steps or thresholds[0] != 0 or thresholds != sorted(set(thresholds)):
            raise ValueError(
                f"StepSchedule: thresholds {thresholds!r}; expected increasing thresholds "
                "starting at 0, e.g. [(0, 768), (250e9, 1536)]."
            )
        sizes = [v / per_micro_step for _, v in steps]
        for (_, v), size in zip(steps, sizes):
            if not (v > 0 and (per_micro_step == 1 or size.is_integer())):
                raise ValueError(
                    f"StepSchedule: size {v:g} is not a positive multiple of per_micro_step="
                    f"{per_micro_step!r}; expected whole numbers of micro-steps."
                )
        super().__init__(minimum=min(sizes), maximum=max(sizes))
        self.steps, self.by, self.per_micro_step = steps, by, per_micro_step
        self._thresholds, self._sizes = thresholds, [int(v) if v.is_integer() else v for v in sizes]

    @classmethod
    def parse(cls, text: str, *, by: str = "items", per_micro_step: float = 1) -> StepSchedule:
        """Read ``"0:768 250B:1536"``: ``threshold:size`` pairs separated by spaces or commas,
        thresholds with an optional K/M/B (or G)/T suffix (10^3 .. 10^12); ValueError else."""
        steps = []
        for part in re.split(r"[\s,]+", text.strip()):
            number = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)"
            pattern = rf"({number}(?:E[+-]?[0-9]+)?)([KMBGT]?):({number})"
            match = re.fullmatch(pattern, part.upper())
            if match is None:
                raise ValueError(
                    f"StepSchedule.parse: {part!r} in {text!r} is not threshold:size; expected "
                    "e.g. '0:768 250B:1536 500B:3072' (suffixes K, M, B or G, T)."
                )
            steps.append((float(match[1]) * _SUFFIX[match[2]], float(match[3])))
        return cls(steps, by=by, per_micro_step=per_micro_step)

    def size(self, updates: int, items_seen: float) -> Any:
        done = updates if self.by == "updates" else items_seen
        return self._sizes[max(0, bisect.bisect_right(self._thresholds, done) - 1)]

    def __repr__(self) -> str:
        steps, per = " ".join(f"{t!r}:{v:g}" for t, v in self.steps), self.per_micro_step
        return f"StepSchedule.parse({steps!r}, by={self.by!r}, per_micro_step={per!r})"


class AdaptiveBatch(Schedule):
    """Grow the window toward the measured gradient noise scale, between ``minimum`` and
    ``maximum`` (micro-steps with ``every=``, items with ``every_items=``), never shrinking:
    from ``warmup`` updates on, every ``every_updates`` updates, to ``fraction *
    opt.noise_scale.value`` (in micro-steps: divided by the last window's batch per micro-step),
    at most ``growth`` times the current size (``NoiseScale()`` on if needed); else ValueError."""

    def __init__(
        self,
        minimum: float,
        maximum: float,
        *,
        fraction: float = 1.0,
        growth: float = 2.0,
        warmup: int = 10,
        every_updates: int = 1,
    ) -> None:
        reals = {"minimum": minimum, "maximum": maximum, "fraction": fraction, "growth": growth}
        for name, value in reals.items():
            _real("AdaptiveBatch", name, value)
        _real("AdaptiveBatch", "warmup", warmup, int)
        _real("AdaptiveBatch", "every_updates", every_updates, int)
        if not (0 < minimum <= maximum and fraction > 0 and growth > 1 and every_updates >= 1):
            raise ValueError(
                f"AdaptiveBatch: minimum={minimum!r}, maximum={maximum!r}, growth={growth!r}, "
                f"fraction={fraction!r}, every_updates={every_updates!r}; expected 0 < minimum "
                "<= maximum, fraction > 0, growth > 1, every_updates >= 1."
            )
        super().__init__(minimum=minimum, maximum=maximum)
        self.fraction, self.growth = fraction, growth
        self.warmup, self.every_updates = warmup, every_updates
        self.current: float = minimum
        self.noise: Any = None
        self.decided_at, self.in_items = -1, False

    def bind_noise_scale(self, noise: Any, in_items: bool) -> None:
        """Called by the wrapper: the estimator to read, and whether the window is in items."""
        self.noise, self.in_items = noise, in_items

    def size(self, updates: int, items_seen: float) -> Any:
        due = updates >= self.warmup and (updates - self.warmup) % self.every_updates == 0
        if self.noise is not None and due and updates != self.decided_at:
            self.decided_at = updates  # asked again at the same boundary: the same answer
            value = self.noise.value
            per = 1.0 if self.in_items else self.noise.batch_per_micro_step
            if value is not None and value > 0 and per:
                grown = min(self.fraction * value / per, self.current * self.growth, self.maximum)
                self.current = max(self.current, grown if self.in_items else math.floor(grown))
        return self.current if self.in_items else int(self.current)

    def state_dict(self) -> dict[str, Any]:
        """The current size and the update it was decided at."""
        return {"current": self.current, "decided_at": self.decided_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume :meth:`state_dict`."""
        self.current, self.decided_at = state["current"], int(state["decided_at"])

    def __repr__(self) -> str:
        return (
            f"AdaptiveBatch({self.minimum!r}, {self.maximum!r}, fraction={self.fraction!r}, "
            f"growth={self.growth!r}, warmup={self.warmup!r}, current={self.current!r})"
        )

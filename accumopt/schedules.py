"""Window schedules: an effective batch that changes on purpose.

``Accumulate(opt, every=schedule)`` (micro-steps per update) or ``every_items=schedule`` (items
per update) takes, instead of a fixed size, any callable ``f(updates, items_seen) -> size``:
``updates`` is the number of updates applied so far and ``items_seen`` the items (over all
ranks) of those updates (items of weighted micro-steps, ``opt.backward(loss_sum, items=n)``;
with plain ``loss.backward()`` it stays 0: schedule by updates then). The wrapper asks it once
per window, when the window opens, so the size changes only at a boundary and every update is
the exact mean over the window it actually used. A size that is not a whole number of
micro-steps >= 1 (or a positive number of items), or that leaves the schedule's own
``minimum``/``maximum``, is refused with the update it was asked for; nothing accumulated is
lost.

Ready-made schedules:

- :class:`LinearRamp`: from ``start`` to ``end`` over a number of updates or items, in steps
  of ``increment`` (Megatron's ``--rampup-batch-size start increment samples``).
- :class:`StepSchedule`: piecewise constant, thresholds in items (samples or tokens) or
  updates; :meth:`StepSchedule.parse` reads ``"0:768 250B:1536 500B:3072"``.
- :class:`AdaptiveBatch`: grows the window toward the measured gradient noise scale
  (``accumopt.noise``), within bounds, never shrinking.
- :class:`Schedule`: any callable with a ``minimum``/``maximum`` to be held to.

The schedule is not stored in a checkpoint; its position is (updates, items seen, the open
window's size, and ``state_dict()`` for a schedule that has one): build the resuming wrapper with
the same schedule. LR schedulers keep counting real updates (``opt.did_update``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


class Schedule:
    """A window schedule: ``fn(updates, items_seen) -> size``, held to optional bounds.

    Args:
        fn: the schedule (subclasses override :meth:`size` instead).
        minimum, maximum: the sizes it must stay within; a size outside is refused, naming the
            update (a schedule that shrinks below its minimum is a bug, not a request).
    """

    def __init__(
        self,
        fn: Callable[[int, float], Any] | None = None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> None:
        self.fn = fn
        self.minimum = minimum
        self.maximum = maximum

    def __call__(self, updates: int, items_seen: float) -> Any:
        return self.size(updates, items_seen)

    def size(self, updates: int, items_seen: float) -> Any:
        """The size of the window that opens after ``updates`` updates of ``items_seen``
        items."""
        if self.fn is None:
            raise NotImplementedError("Schedule: give fn, or override size()")
        return self.fn(updates, items_seen)

    def __repr__(self) -> str:
        return f"Schedule({self.fn!r}, minimum={self.minimum!r}, maximum={self.maximum!r})"


def _progress(by: str, updates: int, items_seen: float) -> float:
    return float(updates) if by == "updates" else items_seen


class LinearRamp(Schedule):
    """From ``start`` to ``end`` (micro-steps, or items with ``every_items=``), linearly over
    ``over_updates`` updates or ``over_items`` items seen, then ``end``.

    The size grows in steps of ``increment`` (default 1), each held for an equal share of the
    ramp, as Megatron-LM's ``--rampup-batch-size <start> <increment> <ramp samples>`` does.
    A ramp down (``end < start``) works the same way.

    Example::

        every=LinearRamp(2, 16, over_updates=100)       # 2 -> 16 micro-steps in 100 updates
        every_items=LinearRamp(256, 4096, over_items=1e6, increment=256)
    """

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
        over = float(over_updates if over_updates is not None else over_items)  # type: ignore[arg-type]
        if not (over > 0 and start > 0 and end > 0 and increment > 0):
            raise ValueError(
                f"LinearRamp: start={start!r}, end={end!r}, increment={increment!r}, "
                f"over={over!r}; expected all > 0."
            )
        super().__init__(minimum=min(start, end), maximum=max(start, end))
        self.start, self.end, self.increment, self.over = start, end, increment, over
        self.by = "updates" if over_updates is not None else "items"

    def size(self, updates: int, items_seen: float) -> Any:
        done = min(1.0, _progress(self.by, updates, items_seen) / self.over)
        span = self.end - self.start
        steps = math.floor(abs(span) / self.increment * done + 1e-9)
        value = self.start + math.copysign(steps * self.increment, span)
        return self.end if done >= 1.0 else value

    def __repr__(self) -> str:
        return (
            f"LinearRamp({self.start!r}, {self.end!r}, over_{self.by}={self.over:g}, "
            f"increment={self.increment!r})"
        )


class StepSchedule(Schedule):
    """Piecewise constant: ``steps[i] = (threshold, size)``: from ``threshold`` items seen (or
    updates, ``by="updates"``) on, the window is ``size / per_micro_step``.

    Args:
        steps: ``(threshold, size)`` pairs, thresholds increasing from 0.
        by: ``"items"`` (samples or tokens seen) or ``"updates"``.
        per_micro_step: items one micro-step holds over all ranks (rows x ranks), for
            ``every=``: the sizes are batch sizes in items, divided by it (each must divide);
            1 for ``every_items=`` (sizes in items).

    Example::

        every_items=StepSchedule.parse("0:768 250K:1536 500K:3072")     # samples per update
        every=StepSchedule.parse("0:768 250K:1536", per_micro_step=64)  # 12, then 24 micro-steps
    """

    def __init__(
        self, steps: Sequence[tuple[float, float]], *, by: str = "items", per_micro_step: float = 1
    ) -> None:
        if by not in ("items", "updates"):
            raise ValueError(f"StepSchedule: by={by!r}; expected 'items' or 'updates'.")
        steps = [(float(t), float(v)) for t, v in steps]
        thresholds = [t for t, _ in steps]
        if not steps or thresholds[0] != 0 or thresholds != sorted(set(thresholds)):
            raise ValueError(
                f"StepSchedule: thresholds {thresholds!r}; expected increasing thresholds "
                "starting at 0, e.g. [(0, 768), (250e9, 1536)]."
            )
        for _, v in steps:
            if not (v > 0 and (per_micro_step == 1 or (v / per_micro_step).is_integer())):
                raise ValueError(
                    f"StepSchedule: size {v:g} is not a positive multiple of per_micro_step="
                    f"{per_micro_step!r}; expected batch sizes that a whole number of "
                    "micro-steps holds."
                )
        sizes = [v / per_micro_step for _, v in steps]
        super().__init__(minimum=min(sizes), maximum=max(sizes))
        self.steps, self.by, self.per_micro_step = steps, by, per_micro_step
        self._sizes = [int(v) if v.is_integer() else v for v in sizes]

    @classmethod
    def parse(cls, text: str, *, by: str = "items", per_micro_step: float = 1) -> StepSchedule:
        """Read ``"0:768 250B:1536 500B:3072"``: ``threshold:size`` pairs separated by spaces
        or commas, thresholds with an optional K/M/B (or G)/T suffix (10^3 .. 10^12)."""
        steps = []
        for part in re.split(r"[\s,]+", text.strip()):
            match = re.fullmatch(r"([0-9.]+(?:[eE][0-9]+)?)([KMBGT]?):([0-9.]+)", part.upper())
            if match is None:
                raise ValueError(
                    f"StepSchedule.parse: {part!r} in {text!r} is not threshold:size; expected "
                    "e.g. '0:768 250B:1536 500B:3072' (suffixes K, M, B or G, T)."
                )
            steps.append((float(match[1]) * _SUFFIX[match[2]], float(match[3])))
        return cls(steps, by=by, per_micro_step=per_micro_step)

    def size(self, updates: int, items_seen: float) -> Any:
        done = _progress(self.by, updates, items_seen)
        chosen = self._sizes[0]
        for (threshold, _), size in zip(self.steps, self._sizes):
            if done >= threshold:
                chosen = size
        return chosen

    def __repr__(self) -> str:
        steps = " ".join(f"{t:g}:{v:g}" for t, v in self.steps)
        return (
            f"StepSchedule.parse({steps!r}, by={self.by!r}, per_micro_step={self.per_micro_step!r})"
        )


class AdaptiveBatch(Schedule):
    """Grow the window toward the measured gradient noise scale, between ``minimum`` and
    ``maximum`` (micro-steps with ``every=``, items with ``every_items=``), never shrinking.

    At each boundary after ``warmup`` updates it reads ``opt.noise_scale.value`` (turned on
    for it: ``accumopt.noise``), the critical batch estimate ``B_simple``, and sets the window
    to ``fraction * B_simple`` (converted to micro-steps with the last window's batch per
    micro-step), but at most ``growth`` times the current size, and never less than it. The
    micro-batch stays what it is: only the number of micro-steps per update changes. The
    estimate it reads is the wrapper's ``noise_scale`` (``NoiseScale()`` when not given, which
    measures one window per 16 micro-steps: short windows then see few estimates; pass
    ``noise_scale=NoiseScale(every_windows=1)`` for one per window).

    Args:
        minimum, maximum: the bounds (the first window has ``minimum``).
        fraction: the share of ``B_simple`` to aim at (1.0: the critical batch itself).
        growth: the largest factor of one change.
        warmup: updates before the first change (the estimate needs windows to average).
        every_updates: updates between two changes.
    """

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
        if not (0 < minimum <= maximum and fraction > 0 and growth > 1 and every_updates >= 1):
            raise ValueError(
                f"AdaptiveBatch: minimum={minimum!r}, maximum={maximum!r}, growth={growth!r}, "
                f"fraction={fraction!r}, every_updates={every_updates!r}; expected "
                "0 < minimum <= maximum, fraction > 0, growth > 1, every_updates >= 1."
            )
        super().__init__(minimum=minimum, maximum=maximum)
        self.fraction, self.growth = fraction, growth
        self.warmup, self.every_updates = warmup, every_updates
        self.current: float = minimum
        self.decided_at = -1
        self.noise: Any = None
        self.in_items = False

    def bind_noise_scale(self, noise: Any, in_items: bool) -> None:
        """Called by the wrapper: the estimator to read, and the window's unit."""
        self.noise, self.in_items = noise, in_items

    def size(self, updates: int, items_seen: float) -> Any:
        due = updates >= self.warmup and (updates - self.warmup) % self.every_updates == 0
        if self.noise is not None and due and updates != self.decided_at:
            self.decided_at = updates  # asked again at the same boundary: the same answer
            self.current = self._grown(self.noise.value, self.noise.batch_per_micro_step)
        return self.current if self.in_items else int(self.current)

    def _grown(self, value: float | None, per_step: float | None) -> float:
        if value is None or not value > 0:
            return self.current
        target = self.fraction * value
        if not self.in_items:
            if not per_step:
                return self.current
            target = target / per_step
        assert self.maximum is not None
        grown = min(target, self.current * self.growth, self.maximum)
        if not self.in_items:
            grown = math.floor(grown)
        return max(self.current, grown)

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

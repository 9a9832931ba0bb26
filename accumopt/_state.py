"""The accumulation window as one record, :class:`State`, and its rules as functions over it.

- A window closes at its N-th micro-step (``every=N``) or at the first micro-step whose running
  item total reaches T (``every_items=T``, up to that sum's float rounding); a window's size
  may come from a schedule ``f(updates, items_seen)``, asked when the window opens (and again
  before a micro-step joins it while it has no valid size).
- Its micro-steps are all *weighted* (``opt.backward(loss_sum, items=n)``, ``next_items(n)``)
  or all unweighted; a window in items takes only weighted ones.
- Its divisor: the item total if weighted (None, "skip the update", at 0), the micro-steps of
  all ranks if not, 1 for ``reduction="sum"``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

if TYPE_CHECKING:
    from torch import Tensor

SizeFn = Callable[[int, float], Any]
"""A window schedule: ``f(updates, items_seen)`` -> the size of the window that opens now."""

_ROUNDING = 2.0 * sys.float_info.epsilon  # relative rounding per float addition (see reaches)


class Phase(enum.Enum):
    """Where the window is.

    - ``OPEN``: it takes micro-steps (it may be empty).
    - ``PASS``: a backward pass into it is running; seen between calls, that pass died
      part-way and its partial gradient is in ``.grad`` (``discard()``, or
      ``drop_micro_step()`` with the rollback buffer).
    - ``HELD``: a finished pass waits to be counted (``commit()``) or dropped
      (``drop_micro_step()``): ``backward(..., hold=True)``, or a pass of an
      :class:`accumopt.MicroStepGroup`.
    - ``CLOSED``: the window is full and its gradient formed; the next ``step()`` applies it.
    - ``APPLY``: the inner optimizer is stepping on the window (the only phase it may step in).
    - ``BROKEN``: a call into the wrapper is changing it, or failed part-way (seen between
      calls); only ``discard()`` and ``load_state_dict()`` go on from here.
    """

    OPEN = "open"
    PASS = "pass"
    HELD = "held"
    CLOSED = "closed"
    APPLY = "apply"
    BROKEN = "broken"


@dataclasses.dataclass(slots=True)
class State:
    """The window's record. ``micro_step``: micro-steps counted in the open window; ``items``:
    their items (0.0 if unweighted; a 0-dim tensor, summed without a host sync, while a window
    in micro-steps gets tensor counts; over all ranks in a window in items, else this rank's
    until the close); ``weighted``: their kind (None while empty); ``stepped``: no counted
    micro-step waits for its ``step()``; ``size``: the open window's (None: no valid one from
    its schedule yet); ``updates``, ``items_seen``: inner steps applied and their items (all
    ranks); ``did_update``: the last ``step()``/``flush()`` applied one (False again at the
    next micro-step); ``found_inf``: AMP's 0-dim inf/NaN flag, or None; ``least``: the smallest
    item count given as a tensor (checked at the close), or None; ``broken``: what
    failed, while BROKEN."""

    phase: Phase = Phase.OPEN
    micro_step: int = 0
    items: float | Tensor = 0.0
    weighted: bool | None = None
    stepped: bool = True
    size: float | None = None
    updates: int = 0
    items_seen: float = 0.0
    did_update: bool = False
    found_inf: Tensor | None = None
    least: Tensor | None = None
    broken: str = ""


SAVED = ("micro_step", "items", "weighted", "stepped", "size", "updates", "items_seen")
"""The fields a checkpoint holds (with the phase, OPEN or CLOSED, and the AMP flag)."""


def reset(state: State) -> None:
    """Empty the window (the cumulative counters stay)."""
    state.micro_step, state.items, state.weighted = 0, 0.0, None
    state.found_inf = state.least = None


class Window(NamedTuple):
    """What the last window that reached its boundary was (``Accumulate.last_window``).

    Attributes:
        micro_steps: its micro-steps (this rank's; every rank runs as many).
        items: its items over all ranks (0.0 if unweighted).
        grad_norm: the 2-norm of its gradient before clipping (0-dim tensor on the gradients'
            device, no host sync) when ``max_grad_norm`` is set, else None.
        updated: whether the inner optimizer stepped (False: skipped for an inf/NaN, or a
            weighted window of zero items).
    """

    micro_steps: int
    items: float
    grad_norm: Tensor | None
    updated: bool


def reaches(micro_step: int, items: float | Tensor, every: float | None, in_items: bool) -> bool:
    """Whether ``micro_step`` micro-steps of ``items`` items fill a window of size ``every``
    (micro-steps, or items when ``in_items``). A running sum of fractional items falls short
    by its rounding (ten items of 0.1 sum to 0.999...9): a total short of the size by at most
    ``micro_step`` roundings reaches it; whole numbers below 2**53 add exactly."""
    if every is None:
        return False
    if not in_items:
        return micro_step >= every
    return bool(items >= every * (1.0 - micro_step * _ROUNDING))  # float items here


class Rules:
    """The window settings the wrapper was built with, and the rules that need them.

    Args:
        every, every_items: exactly one is given (validated by the caller): a size, or a
            schedule (a callable).
        reduction: ``"mean"`` or ``"sum"``.
    """

    def __init__(self, every: Any, every_items: Any, reduction: str) -> None:
        self.in_items = every_items is not None
        given = every_items if self.in_items else every
        self.schedule: SizeFn | None = given if callable(given) else None
        self.fixed: float | None = None if self.schedule else float(given)
        self.reduction = reduction

    def open(self, state: State) -> None:
        """Empty the window; a fixed size is its size, a schedule is asked by :meth:`sized`."""
        reset(state)
        state.size = self.fixed

    def ask(self, state: State) -> str | None:
        """Ask the schedule for the open window's size: None when it gave a valid one (set),
        else why not. A schedule that raises leaves the window without a size."""
        assert self.schedule is not None
        size = self.schedule(state.updates, state.items_seen)
        problem = self.size_problem(size, state)
        if problem is None:
            state.size = float(size)
        return problem

    def sized(self, state: State) -> str | None:
        """None when the open window has a size (asking a schedule that gave none again, which
        may raise), else why it has none."""
        return None if state.size is not None else self.ask(state)

    def size_problem(self, size: Any, state: State) -> str | None:
        """Why ``size`` cannot be the size of the window opening after ``state.updates``
        updates (a message), or None."""
        low = getattr(self.schedule, "minimum", None)
        high = getattr(self.schedule, "maximum", None)
        real = isinstance(size, numbers.Real) and not isinstance(size, bool)
        if self.in_items:
            ok = real and math.isfinite(float(size)) and float(size) > 0
            expected = "a positive finite number of items"
        else:
            ok = real and float(size).is_integer() and size >= 1
            expected = "a whole number of micro-steps >= 1"
        if ok and low is not None and size < low:
            ok, expected = False, f"at least its minimum {low:g} (it shrank below the bound)"
        if ok and high is not None and size > high:
            ok, expected = False, f"at most its maximum {high:g}"
        if ok:
            return None
        return (
            f"Accumulate: the window schedule {self.schedule!r} gave {size!r} for update "
            f"{state.updates + 1} (after {state.items_seen:g} items); expected {expected}. "
            "Fix the schedule: the window is empty and the schedule is asked again at the "
            "next backward pass."
        )

    def full(self, state: State) -> bool:
        """Whether the counted micro-steps (or items) fill the open window."""
        size = state.size
        if size is None or not self.in_items:
            return size is not None and state.micro_step >= size
        return reaches(state.micro_step, state.items, size, True)

    def next_closes(self, state: State) -> bool:
        """Whether the next micro-step surely closes the window (``every=N`` with a size)."""
        size = state.size
        return not self.in_items and size is not None and state.micro_step + 1 >= size

    def divisor(self, state: State, world_size: int = 1) -> float | None:
        """What the window's sum over all ranks is divided by (None: skip the update)."""
        if self.reduction == "sum":
            return 1.0
        if state.weighted:  # the items are read (a float) once the window closes
            items = cast(float, state.items)
            return items if items > 0 else None
        return float(state.micro_step * world_size)

    def refusal(self, state: State, weighted: bool) -> tuple[type[Exception], str] | None:
        """Why a micro-step of this kind cannot join the window now, or None."""
        if state.size is None and (problem := self.ask(state)) is not None:
            return ValueError, problem
        if state.micro_step and weighted is state.weighted and state.phase is not Phase.CLOSED:
            return None  # the usual micro-step: one more of the window's kind
        if state.phase is Phase.CLOSED:
            return RuntimeError, (
                f"Accumulate: the window closed after {state.micro_step} micro-step(s) and "
                "step() has not been called since; call opt.step() before the next backward "
                "pass (or drop another live Accumulate over these parameters)."
            )
        if self.in_items and not weighted:
            return ValueError, (
                f"Accumulate: this wrapper closes its window every {state.size:g} items, but a "
                "backward pass came without an item count; expected opt.backward(loss_sum, "
                "items=n) or opt.next_items(n) before every backward pass."
            )
        if state.micro_step and weighted != state.weighted:
            kinds = ("weighted (with items)", "unweighted (no items)")
            first, now = kinds if state.weighted else kinds[::-1]
            return ValueError, (
                f"Accumulate: the window's {state.micro_step} micro-step(s) are {first}, this "
                f"one is {now}; expected one kind per window (they are normalised "
                "differently). Use one kind throughout, or flush() the window first."
            )
        return None

    def spec(self) -> tuple[Any, Any]:
        """``(every, every_items)`` as given to the constructor (a schedule, if any)."""
        given = self.schedule if self.schedule is not None else self.fixed
        if not self.in_items and given is not None and not callable(given):
            given = int(given)
        return (None, given) if self.in_items else (given, None)

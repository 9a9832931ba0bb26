"""The accumulation window: which micro-steps belong to it, when it closes, what it divides by.

Pure Python state, no tensors and no ``torch.distributed``: the wrapper tells the window about
each counted micro-step (with the item count summed over the ranks, if any) and asks it whether
the window is full and what the window's summed gradient must be divided by. The rules:

- A window is counted in micro-steps (``every=N``: closes at the N-th) or in items
  (``every_items=T``: closes at the first micro-step whose running item total reaches T, up to
  the float rounding of that sum; a micro-batch that overshoots brings all its items in).
- Its micro-steps are of one kind: all *weighted* (``opt.backward(loss_sum, items=n)``) or all
  unweighted (plain ``loss.backward()`` of mean losses). A window in items takes only weighted
  ones.
- The divisor: the window's item total for a weighted window (``None``, "skip the update",
  when that total is 0), the number of micro-steps over all ranks for an unweighted one, 1 for
  ``reduction="sum"``.
- Every counted micro-step waits for its ``step()``; a closed window takes no micro-step until
  ``step()`` (or ``flush()``/``discard()``) has consumed it.
- A window's size may come from a *schedule* (``accumopt.schedules``, or any callable
  ``f(updates, items_seen) -> size``): asked once per window, when it opens (at
  :meth:`Window.reset`), with the number of updates applied so far and the items (over all
  ranks) of those updates. The size is validated then; a bad one is refused with the update it
  was asked for, and the window stays empty (the one before it was applied) until the schedule
  gives a valid size.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor

SizeFn = Callable[[int, float], Any]
"""A window schedule: ``f(updates, items_seen)`` -> micro-steps (``every``) or items
(``every_items``) for the window that opens now."""


_ROUNDING = 2.0 * sys.float_info.epsilon
"""The relative rounding per float addition allowed for in :meth:`Window.full`."""


def reaches(micro_step: int, items: float, every: int | None, every_items: float | None) -> bool:
    """Whether ``micro_step`` micro-steps of ``items`` items reach a window of ``every``
    micro-steps, or else of ``every_items`` items (see :meth:`Window.full`)."""
    if every is not None:
        return micro_step >= every
    assert every_items is not None
    return items >= every_items * (1.0 - micro_step * _ROUNDING)


_UNANSWERED = (
    "Accumulate: the window schedule raised when asked for this window's size; the window is "
    "empty (the one before it was applied) and the schedule is asked again before a "
    "micro-step joins it."
)
"""What :attr:`Window.size_error` holds while the schedule has not answered."""


class WindowReport(NamedTuple):
    """What the last window that reached its boundary was (``Accumulate.last_window``): what
    frameworks log after an update.

    Attributes:
        micro_steps: micro-steps in the window (this rank's; all ranks run the same number).
        items: items in the window, over all ranks (0.0 for an unweighted window).
        grad_norm: the 2-norm of the window's gradient before clipping (0-dim tensor on the
            gradients' device, float32 or the gradients' dtype; no host sync), when
            ``max_grad_norm`` is set (``float("inf")`` measures without clipping); else None.
        updated: whether the inner optimizer stepped (False: skipped for an inf/NaN or for
            zero items).
    """

    micro_steps: int
    items: float
    grad_norm: Tensor | None
    updated: bool


_EMPTY = {
    "micro_step": 0,
    "items": 0.0,
    "weighted": None,
    "closed": False,
    "done": False,
    "inner_base": None,
    "skip": None,
}
"""An empty window's position (see :class:`Window`)."""
_EMPTY_UNANSWERED = {**_EMPTY, "size_error": _UNANSWERED}
"""An empty scheduled window, before the schedule answered."""


class Window:
    """The open window's position, and the rules above.

    Args:
        every: micro-steps per window (int >= 1) or a schedule of them, or None.
        every_items: items per window (float > 0) or a schedule of them, or None; exactly one
            of the two is given (validated by the caller).
        reduction: ``"mean"`` or ``"sum"``.

    Attributes:
        every (int | None), every_items (float | None): the open window's size (with a
            schedule: the size it gave when this window opened).
        schedule (SizeFn | None): the schedule, if any.
        updates (int), items_seen (float): updates applied, and their items over all ranks
            (what the schedule is asked with).
        micro_step (int): micro-steps counted in the open window.
        items (float): items counted in the open window (0.0 if unweighted); under DDP/FSDP2
            over all ranks for a window in items, this rank's own until the boundary otherwise.
        weighted (bool | None): the kind of the window's micro-steps; None while it is empty.
        closed (bool): the window is full and waits for ``step()``.
        done (bool): its update was applied (set by :meth:`applied`, cleared by the reset), so
            a ``step()`` retried after a failed reset only finishes the reset.
        stepped (bool): no counted micro-step waits for its ``step()``.

    Raises:
        ValueError: the schedule gives a bad size for the first window.
    """

    micro_step: int
    items: float
    weighted: bool | None
    closed: bool
    done: bool
    inner_base: int | None  # the inner optimizer's steps before this window's update
    skip: bool | None  # whether this window's update is skipped (decided once)

    def __init__(self, every: Any, every_items: Any, reduction: str) -> None:
        self.in_items = every_items is not None
        size = every_items if self.in_items else every
        self.schedule: SizeFn | None = size if callable(size) else None
        self.every: int | None = None
        self.every_items: float | None = None
        if self.schedule is None:
            self._set_size(size)
        self.reduction = reduction
        self.updates, self.items_seen = 0, 0.0
        self.size_error: str | None = None
        self.stepped = True
        self.reset()

    def _set_size(self, size: Any) -> None:
        if self.in_items:
            self.every_items = float(size)
        else:
            self.every = int(size)

    def reset(self, opened: Callable[[], None] | None = None) -> None:
        """Open a new, empty window (asking the schedule for its size, if any); ``opened`` is
        called once the window is open, before a bad size is raised.

        Raises:
            ValueError: the schedule gave a bad size (see :meth:`size_problem`).
        """
        # one C call (dict.update): a KeyboardInterrupt lands before or after all of them; a
        # scheduled window has no size until the schedule answers
        self.__dict__.update(_EMPTY if self.schedule is None else _EMPTY_UNANSWERED)
        try:
            error = None if self.schedule is None else self.resize()
        finally:
            if opened is not None:
                opened()
        if error is not None:
            raise ValueError(error)

    def resize(self) -> str | None:
        """Ask the schedule for the open window's size: None when it is valid (and set), else
        why not (kept in :attr:`size_error`; the previous size stays). A schedule that raises
        leaves :attr:`size_error` set too: the window has no size yet, and the next micro-step
        (or the runner's next cut) asks again."""
        assert self.schedule is not None
        self.size_error = _UNANSWERED  # until the schedule answers (it may raise)
        size = self.schedule(self.updates, self.items_seen)
        problem = self.size_problem(size)
        if problem is None:
            self._set_size(size)
        self.size_error = problem  # last: interrupted before, the window stays unanswered
        return problem

    def answered(self) -> bool:
        """Whether the open window has a valid size, asking a schedule that has not given one
        (it raised, or gave a bad size) again first."""
        return self.size_error is None or self.resize() is None

    def size_problem(self, size: Any) -> str | None:
        """Why ``size`` cannot be this window's size (message), or None when it can."""
        low = getattr(self.schedule, "minimum", None)
        high = getattr(self.schedule, "maximum", None)
        if self.in_items:
            ok = isinstance(size, numbers.Real) and not isinstance(size, bool)
            ok = ok and math.isfinite(float(size)) and float(size) > 0
            expected = "a positive finite number of items"
        else:
            ok = isinstance(size, numbers.Integral) and not isinstance(size, bool)
            ok = ok or (isinstance(size, float) and size.is_integer())
            ok = ok and size >= 1
            expected = "a whole number of micro-steps >= 1"
        if ok and low is not None and size < low:
            ok, expected = False, f"at least its minimum {low:g} (it shrank below the bound)"
        if ok and high is not None and size > high:
            ok, expected = False, f"at most its maximum {high:g}"
        if ok:
            return None
        return (
            f"Accumulate: the window schedule {self.schedule!r} gave {size!r} for update "
            f"{self.updates + 1} (after {self.updates} update(s) and {self.items_seen:g} "
            f"items); expected {expected}. Nothing accumulated was lost (the window before was "
            "applied, this one is empty): fix the schedule; the next backward pass asks it again."
        )

    def applied(self, updates: int) -> int:
        """The closed window's update was applied (``updates`` before it): count it and its
        items as seen, once (a retried step() after a failed reset calls it again); return
        the update count."""
        if not self.done:  # plain stores, no call between them: an interrupt lands before/after
            seen = self.items_seen + self.items
            self.updates, self.items_seen, self.done = updates + 1, seen, True
        return self.updates

    def report(self, grad_norm: Tensor | None, updated: bool) -> WindowReport:
        """What the window that reached its boundary was (before :meth:`reset`)."""
        return WindowReport(self.micro_step, self.items, grad_norm, updated)

    def refusal(self, weighted: bool) -> tuple[type[Exception], str] | None:
        """Why a micro-step of this kind cannot join the window now (exception type and
        message), or None when it can."""
        if not self.answered():
            return ValueError, str(self.size_error)  # the schedule's problem
        if self.closed:
            return RuntimeError, (
                f"Accumulate: the window closed after {self.micro_step} micro-step(s) and step() "
                "has not been called since; expected step() after every backward pass (call "
                "opt.step() before the next backward; or drop another live Accumulate over "
                "these parameters, which counts this pass too)."
            )
        if self.every_items is not None and not weighted:
            return ValueError, (
                f"Accumulate: this wrapper closes its window every {self.every_items:g} items, "
                "but a backward pass came without an item count; expected "
                "opt.backward(loss_sum, items=n) for every micro-batch."
            )
        if self.micro_step and weighted != self.weighted:
            kinds = ("weighted (opt.backward(loss, items=n))", "unweighted (plain backward)")
            first, now = (kinds[0], kinds[1]) if self.weighted else (kinds[1], kinds[0])
            return ValueError, (
                f"Accumulate: the open window's {self.micro_step} micro-steps are {first}, this "
                f"one is {now}; expected one kind per window, since their gradients are "
                "normalised differently. Use one kind throughout (or flush() the window first)."
            )
        return None

    def count(self, items: float | None) -> bool:
        """Count one micro-step (``items``: its item count over all ranks, None if
        unweighted); return whether it fills the window (which is then closed)."""
        self.weighted = items is not None
        self.micro_step += 1
        if items is not None:
            self.items += items
        self.closed = self.full()
        return self.closed

    def full(self) -> bool:
        """Whether the counted micro-steps (or items) reach the window's size. A running sum of
        fractional items falls short by its rounding (ten items of 0.1 sum to 0.999...9): one
        short by at most ``micro_step`` roundings of the size reaches it (integer counts below
        2**53 add exactly, so whole items close exactly at the size)."""
        return reaches(self.micro_step, self.items, self.every, self.every_items)

    def next_closes(self) -> bool:
        """Whether the next micro-step surely closes the window (known only for ``every=N``
        with a valid size: not while a schedule has not given one)."""
        every = self.every
        return self.size_error is None and every is not None and self.micro_step + 1 >= every

    def divisor(self, world_size: int = 1) -> float | None:
        """What the window's sum over all ranks is divided by; None for a weighted window
        without items (its update is skipped)."""
        if self.reduction == "sum":
            return 1.0
        if self.weighted:
            return self.items if self.items > 0 else None
        return float(self.micro_step * world_size)

    # ------------------------------------------------------------------ checkpoints

    def settings(self) -> tuple[int | None, float | None, str]:
        """``(every, every_items, reduction)``: what a checkpoint's window must match (the
        open window's size, with a schedule)."""
        return self.every, self.every_items, self.reduction

    def spec(self) -> tuple[Any, Any]:
        """``(every, every_items)`` as given to the constructor (a schedule, if any)."""
        given = self.schedule if self.schedule is not None else self.every_items or self.every
        return (None, given) if self.in_items else (given, None)

    def progress(self) -> dict[str, Any]:
        """Where the schedule stands, for a checkpoint (format 3): updates, items seen, the
        open window's size and the schedule's own state (``state_dict()``, if it has one)."""
        state = getattr(self.schedule, "state_dict", None)
        return {
            "updates": self.updates,
            "items_seen": self.items_seen,
            "size": self.every_items if self.in_items else self.every,
            "schedule_state": state() if callable(state) else None,
        }

    def restore_progress(self, progress: dict[str, Any]) -> None:
        """Resume the schedule at :meth:`progress` (the open window is resized by the next
        :meth:`reset`, or set by :meth:`restore`)."""
        self.updates = int(progress["updates"])
        self.items_seen = float(progress["items_seen"])
        load = getattr(self.schedule, "load_state_dict", None)
        if callable(load) and progress.get("schedule_state") is not None:
            load(progress["schedule_state"])

    def position(self) -> dict[str, Any]:
        """The open window's position, for a checkpoint (``"size"`` None while the schedule
        has given no valid size: a copy asks it again too)."""
        size = self.every_items if self.in_items else self.every
        return {
            "micro_step": self.micro_step,
            "items": self.items,
            "weighted": self.weighted,
            "closed": self.closed,
            "stepped": self.stepped,
            "size": size if self.size_error is None else None,
        }

    def restore(self, position: dict[str, Any]) -> None:
        """Resume at a position from :meth:`position` (validated by the caller)."""
        self.micro_step = int(position["micro_step"])
        self.items = float(position["items"])
        self.weighted = position["weighted"]
        self.closed = bool(position["closed"])
        self.stepped = bool(position["stepped"])
        if self.schedule is not None and position.get("size") is not None:
            self._set_size(position["size"])  # the size the open window was opened with
            self.size_error = None
        elif self.schedule is not None:  # copied before the schedule gave a valid size
            self.size_error = _UNANSWERED

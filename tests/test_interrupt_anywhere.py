"""Exception safety at line granularity: a KeyboardInterrupt raised at any line of accumopt
that a training loop executes leaves the wrapper consistent (the call happened or it did not)
or refusing until ``discard()``; never half changed.

A trace function raises the interrupt at the N-th line event inside the ``accumopt`` package
(``sys.settrace``), for N over a sample of every line a loop of nine micro-batches in windows
of three executes. The loop goes on by the documented protocol: an exception from a call
means that call may or may not have happened; ``opt.phase`` says what is left: OPEN or
CLOSED, consistent (a closed window still needs its ``step()``); anything else refuses, and
is discarded.
``opt.updates`` says whether an update was applied. Whatever the interrupt hit, each applied
update must equal plain SGD on the mean of the micro-batches the loop saw counted into that
window, in float64.

One line is excluded, the known limit: the first statement of the inner optimizer's post-step
hook (``_watch_inner``'s ``after`` in ``accumulate.py``). An interrupt there comes after the
update and before accumopt can count it, so the update goes uncounted while the parameters
moved; torch's own code between the update and its hooks has the same gap.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import torch
from test_fault_injection import ROWS, X, Y, net, reference

import accumopt
from accumopt import Accumulate, Phase
from accumopt._counting import PENDING

PACKAGE = os.path.dirname(accumopt.__file__)
COUNT_HOOK = os.path.join(PACKAGE, "accumulate.py")


class Interrupt:
    """A trace function raising KeyboardInterrupt at the ``at``-th line event in accumopt."""

    def __init__(self, at: int) -> None:
        self.at, self.lines, self.where = at, 0, ""

    def calls(self, frame: FrameType, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if not name.startswith(PACKAGE):
            return None
        if name == COUNT_HOOK and frame.f_code.co_name == "after":
            return None  # the known limit (module docstring)
        return self.lines_of

    def lines_of(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
                raise KeyboardInterrupt
        return self.lines_of


def paused(opt: Accumulate) -> bool:
    """Whether the wrapper refuses until discard(): a phase that refuses, or an item count
    left waiting by an interrupt between setting it and its pass (read without running a line
    of accumopt's code, which the trace would count)."""
    return opt._state.phase not in (Phase.OPEN, Phase.CLOSED) or PENDING._items is not None


def retried(call: Callable[[], Any]) -> None:
    for _ in range(5):
        try:
            call()
            return
        except KeyboardInterrupt:
            pass
    raise AssertionError("a call was interrupted five times")


def train(opt: Accumulate, model: torch.nn.Module) -> list[list[tuple[int, int]]]:
    """The loop of the module docstring; returns the micro-batches of each applied update."""
    applied: list[list[tuple[int, int]]] = []
    pending: list[tuple[int, int]] = []
    for a, b in ROWS:
        # an interrupt the trace raises at a `with torch.no_grad():` line as the block exits
        # skips its __exit__ (a tracing artefact: no signal lands there), leaving grad off
        torch.set_grad_enabled(True)
        state = opt._state
        micro_step, updates, closed = state.micro_step, state.updates, state.phase is Phase.CLOSED
        with contextlib.suppress(RuntimeError, ValueError, KeyboardInterrupt):  # may not count
            opt.backward(((model(X[a:b]) - Y[a:b]) ** 2).sum(), items=b - a)
        now_closed = state.phase is Phase.CLOSED
        if state.micro_step > micro_step or (now_closed and not closed) or state.updates > updates:
            pending.append((a, b))
        updates = state.updates
        for _ in range(2):  # a closed window still needs its step() after one that did not run
            try:
                opt.step()
                break
            except (RuntimeError, ValueError, KeyboardInterrupt):
                if paused(opt) or state.phase is not Phase.CLOSED:
                    break
        if opt._state.updates > updates:
            applied.append(pending)
            pending = []
        if paused(opt):
            retried(opt.discard)
            pending = []
        retried(opt.zero_grad)
        if paused(opt):
            retried(opt.discard)
            pending = []
    updates = opt._state.updates
    torch.set_grad_enabled(True)
    for _ in range(2):  # a flush() that did not run, the window still to apply
        try:
            opt.flush()
            break
        except (RuntimeError, ValueError, KeyboardInterrupt):
            if paused(opt):
                retried(opt.discard)
            if paused(opt) or opt._state.phase is not Phase.CLOSED:
                break
    if opt._state.updates > updates:
        applied.append(pending)
    return applied


SIZES = [2, 3, 1]  # the window schedule's sizes, update after update (then again)


def build(
    buffer: bool | None, clip: float | None, scheduled: bool = False
) -> tuple[Accumulate, torch.nn.Module]:
    model = net()
    every: Any = (lambda u, _seen: SIZES[u % len(SIZES)]) if scheduled else 3
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1), every=every, buffer=buffer, max_grad_norm=clip
    )
    return opt, model


@contextlib.contextmanager
def traced(interrupt: Interrupt) -> Iterator[None]:
    """Trace accumopt's lines with ``interrupt``, garbage collection off: a finalizer of an
    earlier test's wrapper (the counter's hook removal) run by the collector inside the loop
    would take the interrupt, which then never reaches the loop."""
    enabled = gc.isenabled()
    gc.disable()
    sys.settrace(interrupt.calls)
    try:
        yield
    finally:
        sys.settrace(None)
        if enabled:
            gc.enable()


def lines_executed(buffer: bool | None, clip: float | None, scheduled: bool) -> int:
    opt, model = build(buffer, clip, scheduled)
    counter = Interrupt(at=0)
    with traced(counter):
        train(opt, model)
    return counter.lines


@pytest.mark.parametrize(
    ("buffer", "clip", "scheduled"), [(None, None, False), (True, 10.0, False), (None, None, True)]
)
def test_a_keyboard_interrupt_at_any_line_leaves_every_update_exact(
    buffer: bool | None, clip: float | None, scheduled: bool
) -> None:
    """With a window schedule, each window also holds the size the schedule gave for it: an
    interrupt while a new window was sized once kept the previous window's size (found by
    review); the last window may be a partial one, flushed."""
    total = lines_executed(buffer, clip, scheduled)
    assert total > 1000  # the loop runs the whole wrapper
    wrong, tried, reached = [], 0, 0
    for at in range(1 + (buffer is True), total + 1, 5):  # every 5th line, offset per setting
        opt, model = build(buffer, clip, scheduled)
        interrupt = Interrupt(at)
        with traced(interrupt):
            applied = train(opt, model)
        torch.set_grad_enabled(True)  # see train()
        tried, reached = tried + 1, reached + bool(interrupt.where)
        if any(not window for window in applied):
            wrong.append((interrupt.where, "an update of no counted micro-batch"))
            continue
        sizes = [len(window) for window in applied]
        expected = [SIZES[u % len(SIZES)] for u in range(len(applied))]
        if scheduled and (sizes[:-1] != expected[:-1] or sizes[-1] > expected[-1]):
            wrong.append((interrupt.where, f"windows of {sizes}, the schedule's {expected}"))
            continue
        for p, q in zip(model.parameters(), reference(applied, clip)):
            if not torch.allclose(p, q, rtol=1e-12, atol=1e-14):
                wrong.append((interrupt.where, f"{(p - q).abs().max().item():.1e}"))
                break
    assert wrong == []
    assert reached > 0.95 * tried  # a run cut short by an interrupt may end before line `at`

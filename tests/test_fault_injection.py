"""Exception safety, the whole kind: an exception injected at each point a training loop's call
can fail leaves the wrapper either consistent or refusing until ``discard()`` (0.2 has no
retry semantics); after that way out, every update it applies is exactly the full-batch
update of the micro-batches it says the window held.

The loop below keeps its own record of which micro-batches each applied window held (a
micro-step counts when ``opt.micro_step`` moved or the window closed; ``discard()`` empties
the record), and the parameters at the end are compared with plain SGD applied window by
window to those micro-batches, in float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from accumopt import Accumulate, Phase, _grads
from accumopt._buffer import WindowBuffer
from accumopt._guard import Guard
from accumopt._state import Rules
from accumopt.distributed import LocalSync

ROWS = [(0, 3), (3, 4), (4, 7), (7, 9), (9, 12), (12, 13), (13, 16), (16, 18), (18, 21)]
X = torch.randn(21, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = torch.randn(21, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
ERRORS = [RuntimeError("injected"), torch.OutOfMemoryError("injected OOM"), KeyboardInterrupt()]


def net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


class Once:
    """Replace ``owner.name`` by a version that raises ``error`` at its ``at``-th call."""

    def __init__(self, owner: Any, name: str, error: BaseException, at: int) -> None:
        self.original, self.error, self.left, self.fired = getattr(owner, name), error, at, False

        def patched(*args: Any, **kwargs: Any) -> Any:
            self.left -= 1
            if self.left == 0:
                self.fired = True
                raise self.error
            return self.original(*args, **kwargs)

        self.patched = patched


def inject(monkeypatch: pytest.MonkeyPatch, point: str, error: BaseException) -> Once:
    """Patch one place a call of the loop can fail, to raise at one of its calls in the
    second window."""
    owner, name, at = {
        "window full": (Rules, "full", 5),
        "window open": (Rules, "open", 3),
        "fold": (WindowBuffer, "micro_step_done", 4),
        "close": (WindowBuffer, "close", 2),
        "note": (Guard, "note", 2),
        "item sum": (LocalSync, "counted", 5),
        "clip": (_grads, "clip_", 2),
    }[point]
    once = Once(owner, name, error, at=at)
    monkeypatch.setattr(owner, name, once.patched)
    return once


def train(opt: Accumulate, model: nn.Module, on_step: Callable[[], None] | None = None) -> Any:
    """The loop, recovering as documented (a call that raised may or may not have happened;
    a wrapper that refuses is discarded); returns the windows applied (micro-batch rows)."""
    applied: list[list[tuple[int, int]]] = []
    pending: list[tuple[int, int]] = []
    failures = 0
    for rows in ROWS:
        a, b = rows
        before = (opt.micro_step, opt.updates)
        try:
            opt.backward(((model(X[a:b]) - Y[a:b]) ** 2).sum(), items=b - a)
        except (RuntimeError, KeyboardInterrupt):
            failures += 1
        counted = opt.micro_step > before[0] or opt.will_update or opt.updates > before[1]
        if counted:
            pending.append(rows)
        updates = opt.updates
        try:
            if on_step is not None:
                on_step()
            opt.step()
        except (RuntimeError, KeyboardInterrupt):
            failures += 1
        if opt.phase not in (Phase.OPEN, Phase.CLOSED):  # refusing: the way out
            opt.discard()
            pending = []
        if opt.updates > updates:
            applied.append(pending)
            pending = []
        opt.zero_grad()
    if opt.flush():
        applied.append(pending)
    return applied, failures


def reference(applied: list[list[tuple[int, int]]], clip: float | None) -> list[torch.Tensor]:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in applied:
        rows = sum(b - a for a, b in window)
        opt.zero_grad()
        loss = sum(((model(X[a:b]) - Y[a:b]) ** 2).sum() for a, b in window)
        (loss / rows).backward()  # type: ignore[operator]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach() for p in model.parameters()]


POINTS = ["window full", "window open", "fold", "close", "note", "item sum", "clip"]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("buffer", [None, True])
def test_an_exception_anywhere_leaves_the_wrapper_done_or_refusing_and_updates_exact(
    point: str, error: BaseException, buffer: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = net()
    clip = 10.0 if point == "clip" else None
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1), every=3, buffer=buffer, max_grad_norm=clip
    )
    once = inject(monkeypatch, point, copy.copy(error))
    applied, failures = train(opt, model)
    assert once.fired and failures >= 1
    assert applied, "no window was applied"
    for p, q in zip(model.parameters(), reference(applied, clip)):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize(
    "where", ["inner step", "inner pre-hook", "inner post-hook", "global post-hook"]
)
def test_an_exception_in_the_inner_optimizer_or_its_hooks_leaves_every_update_exact(
    where: str, error: BaseException
) -> None:
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    left = [2]

    def maybe_raise(*_: Any) -> None:
        left[0] -= 1
        if left[0] == 0:
            raise copy.copy(error)

    if where == "inner step":
        original = inner.step

        def step(closure: Any = None) -> Any:
            maybe_raise()
            return original(closure)

        inner.step = step  # type: ignore[method-assign]
    elif where == "inner pre-hook":
        inner.register_step_pre_hook(maybe_raise)
    opt = Accumulate(inner, every=3)
    if where == "inner post-hook":  # the update is applied, then the hook raises
        inner.register_step_post_hook(maybe_raise)
    handle = None
    if where == "global post-hook":  # run by torch after the optimizer's own post hooks
        handle = register_optimizer_step_post_hook(maybe_raise)
    try:
        applied, failures = train(opt, model)
    finally:
        if handle is not None:
            handle.remove()
    assert failures == 1
    expected = reference(applied, None)
    if where.endswith("post-hook"):  # torch applied the update before its hook raised
        assert opt.updates == len(applied)
    for p, q in zip(model.parameters(), expected):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_interrupted_checkpoint_load_is_recovered_by_loading_again(
    error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, buffer=True)
    for a, b in ROWS[:4]:  # one window and one micro-step of the next
        opt.backward(((model(X[a:b]) - Y[a:b]) ** 2).sum(), items=b - a)
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy({"m": model.state_dict(), "o": opt.state_dict()})
    once = Once(WindowBuffer, "restore", copy.copy(error), at=1)
    monkeypatch.setattr(WindowBuffer, "restore", once.patched)
    with pytest.raises(type(error)):
        opt.load_state_dict(copy.deepcopy(saved["o"]))
    monkeypatch.undo()
    opt.load_state_dict(copy.deepcopy(saved["o"]))  # the way out: load it again
    model.load_state_dict(saved["m"])
    for a, b in ROWS[4:6]:
        opt.backward(((model(X[a:b]) - Y[a:b]) ** 2).sum(), items=b - a)
        opt.step()
        opt.zero_grad()
    assert opt.updates == 2
    for p, q in zip(model.parameters(), reference([ROWS[:3], ROWS[3:6]], None)):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)

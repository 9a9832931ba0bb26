"""The whole state machine of a wrapper against a plain reference model of its rules.

Hypothesis drives a real ``Accumulate`` over a float64 MLP with the calls a training loop makes
(backward passes weighted or not, through ``opt.backward`` or a plain ``loss.backward()``,
``step()``, ``zero_grad()``, ``flush()``, ``discard()``, checkpoints) and the failures real
code meets (a pass that dies part-way, an inner step that raises before or after its update,
gradients wiped outside the wrapper, interleaved refusals). A :class:`Reference` says what the
rules promise: the window's micro-steps and phase after every call, which calls refuse, and
which micro-batches each applied update holds. After every call the wrapper must agree with
it, and its parameters must equal plain SGD applied window by window to those micro-batches.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from accumopt import Accumulate, Phase

X = torch.randn(40, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = torch.randn(40, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
Batch = tuple[int, int, bool]  # first row, rows, weighted (summed loss and items) or mean loss


def net() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    a, n, weighted = batch
    total = ((model(X[a : a + n]) - Y[a : a + n]) ** 2).sum()
    return total if weighted else total / n


class Reference:
    """The rules, as plainly as possible: the open window is the list of its micro-batches."""

    def __init__(self, every: int | None, every_items: float | None) -> None:
        self.every, self.every_items = every, every_items
        self.window: list[Batch] = []
        self.closed = False
        self.refusing = False  # a pass or call failed part-way: only discard() goes on
        self.stepped = True
        self.applied: list[list[Batch]] = []

    def full(self) -> bool:
        if self.every is not None:
            return len(self.window) >= self.every
        assert self.every_items is not None
        return sum(n for _, n, _ in self.window) >= self.every_items

    def refusal(self, batch: Batch) -> bool:
        """Whether a micro-step of ``batch`` cannot join the window."""
        weighted = batch[2]
        if self.closed or (self.every_items is not None and not weighted):
            return True
        return bool(self.window) and self.window[0][2] != weighted

    def count(self, batch: Batch) -> None:
        self.window.append(batch)
        self.closed, self.stepped = self.full(), False

    def apply(self) -> None:
        self.applied.append(self.window)
        self.window, self.closed, self.stepped = [], False, True

    def discard(self) -> None:
        self.window, self.closed, self.refusing, self.stepped = [], False, False, True


def replay(applied: list[list[Batch]]) -> list[torch.Tensor]:
    """Plain SGD, one step per applied window on the window's exact mean loss."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in applied:
        opt.zero_grad()
        if window[0][2]:  # weighted: the summed losses over the window's items
            loss = sum(loss_of(model, b) for b in window) / sum(n for _, n, _ in window)
        else:  # unweighted: the mean of the micro-batches' mean losses
            loss = sum(loss_of(model, b) for b in window) / len(window)
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return [p.detach() for p in model.parameters()]


batches = st.tuples(st.integers(0, 36), st.integers(1, 4), st.booleans())


class WrapperMachine(RuleBasedStateMachine):
    model: nn.Module
    opt: Accumulate
    ref: Reference
    fail_inner: str

    @initialize(
        window=st.one_of(
            st.tuples(st.integers(1, 3), st.none()),
            st.tuples(st.none(), st.sampled_from([3.0, 5.0])),
        ),
        rollback=st.booleans(),
    )
    def build(self, window: tuple[int | None, float | None], rollback: bool) -> None:
        self.model = net()
        inner = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.fail_inner = ""  # "before" / "after": the next inner step raises there
        inner.register_step_pre_hook(lambda *_: self._maybe_fail("before"))
        every, every_items = window
        self.opt = Accumulate(
            inner, every, every_items=every_items, buffer=True if rollback else None
        )
        inner.register_step_post_hook(lambda *_: self._maybe_fail("after"))
        self.ref = Reference(every, every_items)

    def _maybe_fail(self, when: str) -> None:
        if self.fail_inner == when:
            self.fail_inner = ""
            raise RuntimeError(f"injected {when} the update")

    # ------------------------------------------------------------------ micro-steps

    @rule(batch=batches)
    def backward_through_the_wrapper(self, batch: Batch) -> None:
        """``opt.backward``: a refusal comes before anything reaches ``.grad``."""
        refused = self.ref.refusing or self.ref.refusal(batch)
        try:
            self.opt.backward(loss_of(self.model, batch), items=batch[1] if batch[2] else None)
        except (RuntimeError, ValueError):
            assert refused
            return
        assert not refused
        self.ref.count(batch)

    @rule(batch=batches)
    def plain_backward(self, batch: Batch) -> None:
        """``loss.backward()`` (after ``next_items`` for a weighted one): a pass the window
        cannot take is refused at its end, and the wrapper refuses until discard()."""
        if batch[2]:
            try:
                self.opt.next_items(batch[1])
            except (RuntimeError, ValueError):
                assert self.ref.refusing or self.ref.refusal(batch)
                return
        try:
            loss_of(self.model, batch).backward()
        except (RuntimeError, ValueError):
            assert not self.ref.refusing and self.ref.refusal(batch)
            self.ref.refusing = True
            return
        if not self.ref.refusing:  # a refusing wrapper counts nothing (discard() drops it)
            assert not self.ref.refusal(batch)
            self.ref.count(batch)

    @rule(batch=batches)
    def a_pass_dies_part_way(self, batch: Batch) -> None:
        """The last layer's gradient is written, then the pass raises (an OOM, say)."""

        def boom(_: torch.Tensor) -> None:
            raise RuntimeError("OOM in the backward pass")

        hidden = self.model[0](X[batch[0] : batch[0] + batch[1]])
        hidden.register_hook(boom)
        try:
            self.model[2](self.model[1](hidden)).sum().backward()
        except RuntimeError as err:
            assert "OOM" in str(err)
        self.ref.refusing = True

    @precondition(lambda self: self.ref.window and not self.ref.closed and not self.ref.refusing)
    @rule()
    def gradients_wiped_outside(self) -> None:
        """``model.zero_grad()`` inside the window: the next pass refuses it where the window
        lives in ``.grad``; with the rollback buffer it lives in the buffer, untouched."""
        self.model.zero_grad()
        batch = self.ref.window[0]
        if self.opt.rollback:
            self.backward_through_the_wrapper(batch)
            return
        self.ref.refusing = True
        try:
            self.opt.backward(loss_of(self.model, batch), items=batch[1] if batch[2] else None)
        except (RuntimeError, ValueError) as err:
            assert "replaced or cleared" in str(err) or "kind per window" in str(err)
        else:
            raise AssertionError("a wiped window was not refused")

    # ------------------------------------------------------------------ boundaries

    @rule(fail=st.sampled_from(["", "", "before", "after"]))
    def step(self, fail: str) -> None:
        ref = self.ref
        self.fail_inner = fail if ref.closed and not ref.refusing else ""
        updates = self.opt.updates
        try:
            self.opt.step()
        except RuntimeError as err:
            assert ref.refusing or ref.stepped or "injected" in str(err), err
            if "injected before" in str(err):  # nothing applied: refusing until discard()
                ref.refusing = True
            elif "injected after" in str(err):  # applied, counted, the window finished
                ref.apply()
            return
        assert not ref.refusing and not ref.stepped
        if ref.closed:
            ref.apply()
            assert self.opt.updates == updates + 1 and self.opt.did_update
            self.opt.zero_grad()  # as every loop does after an update
        else:
            ref.stepped = True

    @rule()
    def zero_grad(self) -> None:
        self.opt.zero_grad()
        if not self.ref.window and self.opt.phase is Phase.OPEN and self.ref.refusing:
            self.ref.refusing = False  # a pass that died in an empty window is cleared too

    @rule()
    def flush(self) -> None:
        ref = self.ref
        try:
            updated = self.opt.flush()
        except RuntimeError:
            assert ref.refusing
            return
        assert not ref.refusing and updated == bool(ref.window)
        if ref.window:
            ref.apply()

    @rule()
    def discard(self) -> None:
        self.opt.discard()
        self.ref.discard()

    @rule()
    def resume_from_a_checkpoint(self) -> None:
        """Save, then go on in a fresh wrapper over the same model and the saved state."""
        try:
            state = copy.deepcopy(self.opt.state_dict())
        except RuntimeError:
            assert self.ref.refusing
            return
        assert not self.ref.refusing
        inner = torch.optim.SGD(self.model.parameters(), lr=0.1)
        inner.register_step_pre_hook(lambda *_: self._maybe_fail("before"))
        every, every_items = self.ref.every, self.ref.every_items
        fresh = Accumulate(inner, every, every_items=every_items, buffer=self.opt.buffer)
        inner.register_step_post_hook(lambda *_: self._maybe_fail("after"))
        self.opt.discard()  # the old wrapper lets go of the model before the new one counts
        del self.opt
        fresh.load_state_dict(state)  # the window goes on exactly: the invariant replays it
        self.opt = fresh

    # ------------------------------------------------------------------ what must hold

    @invariant()
    def agrees_with_the_reference(self) -> None:
        if not hasattr(self, "opt"):
            return
        opt, ref = self.opt, self.ref
        refusing = opt.phase not in (Phase.OPEN, Phase.CLOSED)
        assert refusing == ref.refusing, (opt.phase, ref.refusing)
        if not refusing:
            assert opt.micro_step == len(ref.window) and opt.will_update == ref.closed
        assert opt.updates == len(ref.applied)
        if len(ref.applied) != getattr(self, "_checked", 0):  # replayed once per update
            self._checked = len(ref.applied)
            for p, q in zip(self.model.parameters(), replay(ref.applied)):
                torch.testing.assert_close(p.detach(), q, rtol=1e-10, atol=1e-12)


WrapperMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, report_multiple_bugs=False
)
test_the_wrapper_follows_its_rules_whatever_the_calls = WrapperMachine.TestCase

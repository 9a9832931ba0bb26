"""MicroBatchRunner's ``"auto"`` windows without the rollback buffer.

A window the runner opens at a size proven for its inputs keeps its micro-steps in ``.grad``
(no copy per micro-batch, no snapshot per attempt); an out-of-memory error there drops the
window and runs it again from its first row, smaller, after restoring the buffers and
generators to where they were when it opened. Every test injects out-of-memory errors at sizes
that ran before (memory that got scarcer) and checks the run against a run that never failed:
bitwise where the sizes are the same, in float64 against plain full-batch steps otherwise.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same_params, data, full_batch_step, mlp, twins
from hypothesis import given, settings
from hypothesis import strategies as st
from test_runner_faults import assert_same_state, bn_net, reference, state_of, train
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner
from accumopt.testing import simulate_oom

pytestmark = pytest.mark.filterwarnings("ignore:accumopt. micro-batches of:UserWarning")

RESTARTED = "window restarted"


class FailAt:
    """Raise ``torch.OutOfMemoryError`` at the given forward calls of ``module`` of more than
    one row (counted from 1 from :meth:`arm`), in its forward pass or in the backward pass
    through its output (after the gradients behind it were accumulated). Records the rows of
    every call and whether it was made to fail."""

    def __init__(self, module: nn.Module, where: str = "forward") -> None:
        self.where, self.calls, self.failing = where, 0, set[int]()
        self.log: list[tuple[int, bool]] = []
        module.register_forward_hook(self._on_forward)

    def arm(self, *calls: int) -> None:
        self.calls, self.failing = 0, set(calls)

    def _on_forward(self, _: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        self.calls += 1
        rows = args[0].shape[0]
        fail = self.calls in self.failing and rows > 1  # one row: NoMicroBatchFits, rightly
        self.log.append((rows, fail))
        if fail and self.where == "forward":
            raise torch.OutOfMemoryError("injected: out of memory")
        if fail and output.requires_grad:

            def die(_: Tensor) -> None:
                raise torch.OutOfMemoryError("injected: out of memory in backward")

            output.register_hook(die)


def sum_loss(model: nn.Module) -> Callable[[tuple[Tensor, Tensor]], Tensor]:
    def loss_fn(b: tuple[Tensor, Tensor]) -> Tensor:
        return ((model(b[0]) - b[1]) ** 2).sum()

    return loss_fn


def make_runner(
    model: nn.Module, every_items: int, **kwargs: Any
) -> tuple[Accumulate, Callable[[Callable[[Any], Tensor], Any], None]]:
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every_items=every_items)
    runner: list[MicroBatchRunner] = []

    def run(loss_fn: Callable[[Any], Tensor], batch: Any) -> None:
        if not runner:
            runner.append(
                MicroBatchRunner(acc, loss_fn, model=model, loss_reduction="sum", **kwargs)
            )
        runner[0](batch)

    return acc, run


def kept_sizes(log: list[tuple[int, bool]], dropped: set[int]) -> list[int]:
    """The rows of the calls that ran and were kept (``dropped``: indices into ``log`` of
    calls that ran but whose window was started again)."""
    return [rows for i, (rows, fail) in enumerate(log) if not fail and i not in dropped]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_inside_a_window_without_rollback_restarts_it_and_leaves_no_trace(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Settled at 5 rows in the first batch; in the third, the second micro-batch of 5 runs
    out of memory (in the forward pass after BatchNorm and Dropout ran, or in the backward pass
    after the last layer's gradients were accumulated): the window restarts from its first
    row, and parameters, BatchNorm statistics, the other buffers and the CPU generator end as
    in a run that used the kept sizes from the start."""
    model = bn_net(5)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)) for _ in "abcd"]
    acc, run = make_runner(model, every_items=12)
    fail = FailAt(model[-1] if where == "forward" else model[1], where)
    loss_fn = sum_loss(model)
    torch.manual_seed(7)
    with simulate_oom(model, 5), caplog.at_level(logging.INFO, logger="accumopt"):
        run(loss_fn, batches[0])
        run(loss_fn, batches[1])
        start = len(fail.log)
        fail.arm(2)
        run(loss_fn, batches[2])
        run(loss_fn, batches[3])
    got = state_of(model)
    assert sum(RESTARTED in r.getMessage() for r in caplog.records) == 1
    # the first call of the third batch ran, then its window was started again
    assert fail.log[start] == (5, False) and fail.log[start + 1] == (5, True)
    sizes = kept_sizes(fail.log, {start})
    assert sum(sizes) == 48
    assert acc.updates == 4
    assert_same_state(got, reference(twin, batches, sizes))


def test_a_window_that_goes_on_in_the_next_call_drops_a_failed_micro_batch_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A window of 24 rows over batches of 12, opened without the rollback buffer: the next
    call finds it open and turns the buffer on first, so an OOM there drops one micro-batch."""
    model = bn_net(6)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)) for _ in "abcd"]
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every_items=24)
    runner = MicroBatchRunner(acc, sum_loss(model), model=model, loss_reduction="sum")
    fail = FailAt(model[-1])
    torch.manual_seed(7)
    with simulate_oom(model, 5), caplog.at_level(logging.INFO, logger="accumopt"):
        runner(batches[0])
        runner(batches[1])  # the search settled: the next window opens without rollback
        runner(batches[2])
        fail.arm(2)
        runner(batches[3])
    got = state_of(model)
    assert acc.updates == 2 and acc.micro_step == 0
    assert not any(RESTARTED in r.getMessage() for r in caplog.records)
    sizes = kept_sizes(fail.log, set())
    assert sum(sizes) == 48
    assert_same_state(got, reference(twin, batches, sizes, every_items=24))


def test_a_larger_size_probed_inside_a_window_is_rolled_back_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """grow_after=2: after two clean micro-steps at the settled size a larger one is probed
    inside a window opened without rollback; the buffer is turned on first, so the probe's
    OOM drops it alone (no restart)."""
    model = bn_net(7)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)) for _ in "abc"]
    acc, run = make_runner(model, every_items=12, grow_after=2)
    with simulate_oom(model, 5) as sim, caplog.at_level(logging.INFO, logger="accumopt"):
        got = train(model, acc, batches, run)
    assert not any(RESTARTED in r.getMessage() for r in caplog.records)
    assert any("probing larger sizes" in r.getMessage() for r in caplog.records)
    sizes = [s for s in sim.sizes if s <= 5]
    assert sum(sizes) == 36
    assert_same_state(got, reference(twin, batches, sizes))


def test_an_error_inside_a_window_without_rollback_drops_it_and_restores_its_start() -> None:
    """A loss_fn that raises (not an OOM) on the second micro-batch of such a window: the
    error propagates; the window is dropped, and parameters, buffers and generator are as
    when it opened; the next batch trains as if the failed one had never been seen."""
    model = bn_net(8)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)) for _ in "abc"]
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every_items=12)
    calls = [0]

    def loss_fn(b: tuple[Tensor, Tensor]) -> Tensor:
        calls[0] += 1
        if calls[0] == -1:
            raise ValueError("a bug in loss_fn")
        return ((model(b[0]) - b[1]) ** 2).sum()

    runner = MicroBatchRunner(acc, loss_fn, model=model, loss_reduction="sum")
    torch.manual_seed(7)
    with simulate_oom(model, 5) as sim:
        runner(batches[0])
        first, before = len(sim.sizes), state_of(model)
        calls[0] = -3  # the second micro-batch of the next call raises
        with pytest.raises(ValueError, match="a bug in loss_fn"):
            runner(batches[1])
        assert acc.micro_step == 0 and acc.updates == 1
        assert_same_state(state_of(model), before)
        third = len(sim.sizes)
        runner(batches[2])
    got = state_of(model)
    sizes = [s for s in sim.sizes[:first] if s <= 5] + sim.sizes[third:]
    assert sum(sizes) == 24
    assert_same_state(got, reference(twin, [batches[0], batches[2]], sizes))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    n=st.integers(2, 12),
    limit=st.integers(1, 12),
    span=st.integers(1, 2),
    where=st.sampled_from(["forward", "backward"]),
    failing=st.sets(st.integers(1, 24), max_size=3),
)
def test_oom_anywhere_at_proven_sizes_keeps_full_batch_updates(
    seed: int, n: int, limit: int, span: int, where: str, failing: set[int]
) -> None:
    """Windows of ``span`` batches of n rows, a simulated limit, and out-of-memory errors
    injected at arbitrary later calls: every update equals a plain float64 step on the mean
    loss of its window's rows, and each call returns the mean loss of its own rows."""
    ref, model = twins(mlp(seed))
    ref, model = ref.double(), model.double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), every_items=n * span
    )
    runner = MicroBatchRunner(
        acc, lambda b: ((model(b[0]) - b[1]) ** 2).sum(), loss_reduction="sum"
    )
    fail = FailAt(model[0], where)
    fail.arm(*failing)
    with simulate_oom(model, limit):
        for w in range(2):
            xs, ys = zip(*(data(seed + w * span + i, n) for i in range(span)))
            x, y = torch.cat(xs).double(), torch.cat(ys).double()
            with torch.no_grad():  # each call's mean loss, under the window's parameters
                means = [((ref(a.double()) - b.double()) ** 2).sum() / n for a, b in zip(xs, ys)]
            full_batch_step(ref, ref_opt, x, y)
            for i in range(span):
                mean = runner((xs[i].double(), ys[i].double()))
                torch.testing.assert_close(mean, means[i], rtol=1e-12, atol=1e-12)
            assert acc.updates == w + 1 and acc.micro_step == 0
            assert_same_params(model, ref)


@pytest.mark.parametrize("source", ["runner", "plain loop"])
def test_a_window_resumed_into_a_runner_with_rollback_loses_nothing_to_an_oom(
    source: str,
) -> None:
    """A window of 36 rows over batches of 12 is checkpointed while open, with its finished
    micro-steps in .grad (a runner's window opened without the rollback buffer, or a plain
    loop), and resumed in a fresh wrapper whose "auto" runner exists before the load (it
    routes every parameter through the buffer): the restored micro-steps are moved into the
    buffer, so the OOM that follows at once drops only its own micro-batch."""
    torch.manual_seed(0)
    x, y = torch.randn(48, 4, dtype=torch.float64), torch.randn(48, 3, dtype=torch.float64)
    rows = [slice(i, i + 12) for i in range(0, 48, 12)]
    ref, model = twins(mlp(3).double())
    source_model = copy.deepcopy(model)

    def build(net: nn.Module) -> tuple[Accumulate, MicroBatchRunner]:
        acc = Accumulate(torch.optim.SGD(net.parameters(), lr=0.1), every_items=36)
        return acc, MicroBatchRunner(acc, sum_loss(net), start_size=4, loss_reduction="sum")

    if source == "plain loop":  # a wrapper without a runner: no rollback buffer
        acc = Accumulate(torch.optim.SGD(source_model.parameters(), lr=0.1), every_items=36)
        acc.backward(sum_loss(source_model)((x[rows[0]], y[rows[0]])), items=12)
        acc.step()
        acc.zero_grad()
        resumed, windows = rows[1:3], [torch.arange(36)]
    else:
        acc, runner = build(source_model)
        for r in rows:  # the first window closes at row 36; the second opens without rollback
            runner((x[r], y[r]))
        assert not acc.rollback
        resumed, windows = rows[:2], [torch.arange(36), torch.arange(36, 72) % 48]
    assert acc.micro_step > 0
    saved, weights = copy.deepcopy(acc.state_dict()), copy.deepcopy(source_model.state_dict())
    acc2, runner2 = build(model)  # its runner turns rollback on before the load
    model.load_state_dict(weights)
    acc2.load_state_dict(saved)
    with simulate_oom(model, 3) as sim:
        for r in resumed:
            runner2((x[r], y[r]))
    assert sim.raised and acc2.micro_step == 0 and acc2.updates == len(windows)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for window in windows:
        full_batch_step(ref, opt, x[window], y[window])
    assert_same_params(model, ref)

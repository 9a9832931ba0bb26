"""The runner's lean micro-step (``Accumulate._lean_micro_step``): inside a window, a
micro-batch that neither opens nor closes it is run and counted without the wrapper's layers
(no end-of-pass bookkeeping, no ``step()`` call). It must leave the wrapper exactly as the full
path leaves it (same counts, reports, gradients and parameters, bit for bit), give way to the
full path wherever something else could happen, and fail as the full path fails."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import OPTIMIZERS, assert_same_params, data, mlp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accumopt import Accumulate, MicroBatchRunner

Batch = tuple[torch.Tensor, torch.Tensor]


def full_path_only(acc: Accumulate) -> None:
    """Make ``acc`` refuse every lean micro-step: the runner then takes the full path."""
    acc._lean_micro_step = lambda *_: None  # type: ignore[method-assign]


def spy(acc: Accumulate) -> list[bool]:
    """Record, per runner micro-step that asked, whether the lean path took it."""
    taken: list[bool] = []
    lean = acc._lean_micro_step

    def recorded(loss: torch.Tensor, items: float) -> bool | None:
        stepped = lean(loss, items)
        taken.append(stepped is not None)
        return stepped

    acc._lean_micro_step = recorded  # type: ignore[method-assign]
    return taken


def middles(acc: Accumulate) -> list[bool]:
    """Record, per micro-step of ``acc``'s full path, whether it was a middle one: neither
    the first of its window nor the one that closed it."""
    seen: list[bool] = []
    backward = acc._backward_here

    def recorded(loss: torch.Tensor, items: float) -> None:
        first = acc.micro_step == 0
        backward(loss, items)
        seen.append(not first and not acc.will_update)

    acc._backward_here = recorded  # type: ignore[method-assign]
    return seen


def state(acc: Accumulate, model: nn.Module) -> tuple[Any, ...]:
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return (
        acc.micro_step,
        acc.items,
        acc.will_update,
        acc.updates,
        acc.did_update,
        acc.last_window,
        acc._counter.paused,
        acc._window.stepped,  # step() refuses a second call without a backward pass between
        grads,
        [p.detach().clone() for p in model.parameters()],
    )


def assert_same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    *counts_a, grads_a, params_a = a
    *counts_b, grads_b, params_b = b
    assert counts_a == counts_b
    for ga, gb in zip(grads_a, grads_b):
        assert (ga is None) == (gb is None) and (ga is None or torch.equal(ga, gb))
    assert all(torch.equal(pa, pb) for pa, pb in zip(params_a, params_b))


def token_loss(model: nn.Module, tokens: bool) -> Callable[[Batch], Any]:
    """Summed loss; with ``tokens``, each row carries 1-3 items (its first input's sign and
    size decide), so windows in items fill at micro-steps the rows do not predict."""

    def loss_fn(b: Batch) -> Any:
        loss = ((model(b[0]) - b[1]) ** 2).sum()
        if not tokens:
            return loss
        weights = 1 + (b[0][:, 0].abs() * 2).clamp(max=2).floor()
        return loss, float(weights.sum())

    return loss_fn


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.lists(st.integers(1, 23), min_size=1, max_size=4),
    micro=st.integers(1, 6),
    window=st.integers(1, 30),
    in_items=st.booleans(),
    tokens=st.booleans(),
    optimizer=st.sampled_from(["sgd", "adamw"]),
    count_at=st.sampled_from(["outputs", "parameters"]),
)
def test_the_lean_path_leaves_the_wrapper_as_the_full_path_does(
    seed: int,
    rows: list[int],
    micro: int,
    window: int,
    in_items: bool,
    tokens: bool,
    optimizer: str,
    count_at: str,
) -> None:
    """Random batches, micro-batch sizes, windows in items (spanning batches or several per
    batch, items other than rows) or in micro-steps, two optimizers, both ways of counting:
    after every runner call both wrappers agree bit for bit, and the lean path took every
    micro-step that neither opened nor closed its window."""
    model = mlp(seed).double()
    twin = copy.deepcopy(model)
    size = {"every_items": window} if in_items else {"every": max(1, window // 4)}
    wrappers = []
    for m in (model, twin):
        at = m if count_at == "outputs" else None
        wrappers.append(Accumulate(OPTIMIZERS[optimizer](list(m.parameters())), **size, model=at))
    lean, full = wrappers
    taken, middle = spy(lean), middles(full)
    full_path_only(full)
    runners = [
        MicroBatchRunner(acc, token_loss(m, tokens), micro_batch_size=micro)
        for acc, m in ((lean, model), (full, twin))
    ]
    x, y = data(seed, sum(rows))
    x, y = x.double(), y.double()
    start = 0
    for n in rows:
        batch = (x[start : start + n], y[start : start + n])
        start += n
        means = [runner(batch) for runner in runners]
        assert torch.equal(means[0], means[1])
        assert_same_state(state(lean, model), state(full, twin))
    assert sum(taken) == sum(middle)


def test_every_middle_micro_step_of_a_window_takes_the_lean_path() -> None:
    """A window of 6 micro-batches run in one call: the first (noted by the window guard) and
    the last (which closes the window) take the full path, the 4 between the lean one; the
    update equals the float64 full-batch one."""
    model = mlp(3).double()
    ref = copy.deepcopy(model)
    x, y = data(3, 12)
    x, y = x.double(), y.double()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=12, model=model)
    taken = spy(acc)
    MicroBatchRunner(acc, token_loss(model, False), micro_batch_size=2)((x, y))
    assert taken == [False, True, True, True, True, False] and acc.updates == 1
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (((ref(x) - y) ** 2).sum() / 12).backward()
    opt.step()
    assert_same_params(model, ref, rtol=1e-12)


@pytest.mark.parametrize("path", ["lean", "full"])
def test_a_pass_that_dies_in_the_middle_of_a_window_fails_as_on_the_full_path(path: str) -> None:
    """The third of four micro-batches dies in its backward pass, after part of its gradient
    was accumulated: the error propagates, the two finished micro-steps stay counted, counting
    stays paused (the next call is refused), and ``discard()`` then a rerun train exactly."""
    model = mlp(5).double()
    ref = copy.deepcopy(model)
    x, y = data(5, 8)
    x, y = x.double(), y.double()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=model)
    if path == "full":
        full_path_only(acc)
    calls = [0]

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    def loss_fn(b: Batch) -> torch.Tensor:
        calls[0] += 1
        hidden = model[0](b[0])
        if calls[0] == 3:
            hidden.register_hook(boom)  # after the last layer's gradient was accumulated
        return ((model[2](model[1](hidden)) - b[1]) ** 2).sum()

    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size=2)
    with pytest.raises(RuntimeError, match="boom"):
        runner((x, y))
    assert acc.micro_step == 2 and acc._counter.paused and not acc.will_update
    with pytest.raises(RuntimeError, match="failed part-way"):
        runner((x, y))
    acc.discard()
    runner((x, y))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (((ref(x) - y) ** 2).sum() / 8).backward()
    opt.step()
    assert acc.updates == 1
    assert_same_params(model, ref, rtol=1e-12)


def test_a_step_hook_registered_inside_loss_fn_sees_every_later_step() -> None:
    """A step pre-hook registered while the second micro-batch's ``loss_fn`` runs sees that
    micro-step's ``step()`` and every later one: the lean path gives way to step hooks."""
    model = mlp(6).double()
    x, y = data(6, 8)
    x, y = x.double(), y.double()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=model)
    seen: list[int] = []
    calls = [0]

    def loss_fn(b: Batch) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            acc.register_step_pre_hook(lambda *_: seen.append(acc.micro_step))
        return ((model(b[0]) - b[1]) ** 2).sum()

    MicroBatchRunner(acc, loss_fn, micro_batch_size=2)((x, y))
    assert seen == [2, 3, 4] and acc.updates == 1


def test_a_nan_micro_batch_mid_window_is_skipped_under_skip_micro_batch() -> None:
    """``nonfinite="skip_micro_batch"``: a micro-batch with a NaN loss in the middle of the
    window is dropped alone (the per-micro-batch policy needs the full path); the update is
    the float64 full-batch one over the other rows."""
    model = mlp(7).double()
    ref = copy.deepcopy(model)
    x, y = data(7, 8)
    x, y = x.double(), y.double()
    y_bad = y.clone()
    y_bad[4] = float("nan")
    acc = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1),
        every_items=6,
        model=model,
        nonfinite="skip_micro_batch",
    )
    MicroBatchRunner(acc, token_loss(model, False), micro_batch_size=2)((x, y_bad))
    assert acc.updates == 1 and acc.skipped_micro_steps == 1
    keep = torch.tensor([0, 1, 2, 3, 6, 7])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (((ref(x[keep]) - y[keep]) ** 2).sum() / 6).backward()
    opt.step()
    assert_same_params(model, ref, rtol=1e-12)


@pytest.mark.parametrize("path", ["lean", "full"])
def test_a_window_continued_from_another_thread_is_refused_as_on_the_full_path(path: str) -> None:
    """The runner runs half a window in the thread that steps the wrapper and the rest from a
    second thread: the second thread's first micro-step is refused at its ``step()`` (counted,
    then counting paused for every thread), the same way on both paths."""
    model = mlp(8).double()
    x, y = data(8, 8)
    x, y = x.double(), y.double()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=model)
    if path == "full":
        full_path_only(acc)
    runner = MicroBatchRunner(acc, token_loss(model, False), micro_batch_size=2)
    runner((x[:4], y[:4]))
    errors: list[BaseException] = []

    def second() -> None:
        try:
            runner((x[4:], y[4:]))
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "thread" in str(errors[0])
    assert acc.micro_step == 3 and acc._counter.paused_reason == "thread"


@pytest.mark.parametrize("path", ["lean", "full"])
def test_a_window_discarded_during_a_middle_pass_is_refused_as_on_the_full_path(path: str) -> None:
    """A backward hook of the second micro-batch discards the window while the pass runs: the
    pass is refused at its end (its item count went with the window), counting stays paused,
    and nothing is applied; ``discard()`` then a rerun train exactly."""
    model = mlp(9).double()
    ref = copy.deepcopy(model)
    x, y = data(9, 8)
    x, y = x.double(), y.double()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=model)
    if path == "full":
        full_path_only(acc)
    calls = [0]

    def loss_fn(b: Batch) -> torch.Tensor:
        calls[0] += 1
        out = model(b[0])
        if calls[0] == 2:
            out.register_hook(lambda g: acc.discard())
        return ((out - b[1]) ** 2).sum()

    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size=2)
    with pytest.raises(ValueError, match="without an item count"):
        runner((x, y))
    assert acc.updates == 0 and acc._counter.paused
    acc.discard()
    runner((x, y))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (((ref(x) - y) ** 2).sum() / 8).backward()
    opt.step()
    assert acc.updates == 1
    assert_same_params(model, ref, rtol=1e-12)


@pytest.mark.parametrize("path", ["lean", "full"])
def test_a_step_hook_registered_during_a_middle_pass_sees_its_step(path: str) -> None:
    model = mlp(10).double()
    x, y = data(10, 8)
    x, y = x.double(), y.double()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=model)
    if path == "full":
        full_path_only(acc)
    seen: list[int] = []
    calls = [0]

    def hook(grad: torch.Tensor) -> None:
        acc.register_step_pre_hook(lambda *_: seen.append(acc.micro_step))

    def loss_fn(b: Batch) -> torch.Tensor:
        calls[0] += 1
        out = model(b[0])
        if calls[0] == 2:
            out.register_hook(hook)
        return ((out - b[1]) ** 2).sum()

    MicroBatchRunner(acc, loss_fn, micro_batch_size=2)((x, y))
    assert seen == [2, 3, 4] and acc.updates == 1

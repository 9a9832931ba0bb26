"""Faults that land late or sideways: after the update but before the gradients are cleared,
in a checkpoint taken between a failed step() and its retry, in a pass that dies before it
reaches the model, in a loop that runs several backward passes per step(). Each either stays
exact against a float64 full-batch reference or raises a clear error before a wrong update."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

import accumopt
from accumopt import Accumulate, MicroBatchRunner
from accumopt.testing import simulate_oom

X = torch.randn(24, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
Y = torch.randn(24, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
ERRORS = [RuntimeError("injected"), KeyboardInterrupt()]


def net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def loss_of(model: nn.Module, a: int, b: int) -> torch.Tensor:
    return ((model(X[a:b]) - Y[a:b]) ** 2).sum()


def micro_step(opt: Accumulate, model: nn.Module, a: int, b: int) -> None:
    opt.backward(loss_of(model, a, b), items=b - a)
    opt.step()
    opt.zero_grad()


def reference(windows: list[list[tuple[int, int]]], make: Any = None) -> list[torch.Tensor]:
    """Plain float64 training, one step per window on the mean loss of its rows."""
    model = net()
    opt = (make or (lambda p: torch.optim.SGD(p, lr=0.1)))(model.parameters())
    for window in windows:
        opt.zero_grad()
        rows = sum(b - a for a, b in window)
        (sum(loss_of(model, a, b) for a, b in window) / rows).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def assert_matches(model: nn.Module, expected: list[torch.Tensor]) -> None:
    for p, q in zip(model.parameters(), expected):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


class RaiseOnce:
    """A callable that raises ``error`` at its ``at``-th call, else calls ``original``."""

    def __init__(self, original: Any, error: BaseException, at: int = 1) -> None:
        self.original, self.error, self.left = original, error, at

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.left -= 1
        if self.left == 0:
            raise self.error
        return self.original(*args, **kwargs)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_flush_that_fails_clearing_the_gradients_leaves_none_in_the_next_window(
    error: BaseException,
) -> None:
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    micro_step(opt, model, 0, 4)
    micro_step(opt, model, 4, 9)
    opt.optimizer.zero_grad = RaiseOnce(opt.optimizer.zero_grad, copy.copy(error))  # type: ignore[method-assign]
    with pytest.raises(type(error)):
        opt.flush()  # its update applied, then clearing .grad failed: cleared again, consistent
    assert opt.updates == 1 and all(p.grad is None for p in model.parameters())
    for a, b in [(9, 12), (12, 18), (18, 24)]:
        micro_step(opt, model, a, b)
    assert opt.updates == 2
    assert_matches(model, reference([[(0, 4), (4, 9)], [(9, 12), (12, 18), (18, 24)]]))


def die_part_way(model: nn.Module) -> None:
    """A backward pass that writes the last layer's gradient, then raises."""
    handle = model[0].weight.register_hook(RaiseOnce(lambda g: g, RuntimeError("OOM")))
    with pytest.raises(RuntimeError, match="OOM"):
        loss_of(model, 0, 5).backward()
    handle.remove()
    assert model[2].weight.grad is not None


def test_loading_a_boundary_checkpoint_after_a_failed_pass_starts_from_no_gradient() -> None:
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    saved = copy.deepcopy(opt.state_dict())
    die_part_way(model)  # the window's first micro-step: the wrapper refuses until discard()
    opt.load_state_dict(saved)  # the other way out: a checkpoint, without the partial gradient
    for a, b in [(0, 6), (6, 10)]:
        micro_step(opt, model, a, b)
    assert opt.updates == 1
    assert_matches(model, reference([[(0, 6), (6, 10)]]))


def test_a_paused_wrapper_is_neither_copied_nor_pickled() -> None:
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    die_part_way(model)
    with pytest.raises(RuntimeError, match="failed part-way"):
        copy.deepcopy(opt)
    opt.discard()
    copy.deepcopy(opt)


def post_hook_raising_once(inner: torch.optim.Optimizer) -> None:
    inner.register_step_post_hook(RaiseOnce(lambda *_: None, RuntimeError("hook")))


@pytest.mark.parametrize("save", ["state_dict", "deepcopy"])
def test_a_step_whose_post_hook_raises_after_the_update_leaves_a_consistent_wrapper(
    save: str,
) -> None:
    """The update is applied and counted, the window finished: a checkpoint taken right after
    holds exactly that (no retry, nothing applied twice)."""
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = Accumulate(inner, every=2)
    post_hook_raising_once(inner)  # the update is applied, then the hook raises
    opt.backward(loss_of(model, 0, 5), items=5)
    opt.step()
    opt.backward(loss_of(model, 5, 9), items=4)
    with pytest.raises(RuntimeError, match="hook"):
        opt.step()
    assert opt.updates == 1 and opt.did_update  # applied, though step() raised
    assert all(p.grad is None for p in model.parameters())
    opt.state_dict() if save == "state_dict" else copy.deepcopy(opt)
    resumed = copy.deepcopy(opt)
    assert resumed.updates == 1 and resumed.micro_step == 0
    assert_matches(model, reference([[(0, 5), (5, 9)]]))


class Head(nn.Module):
    """A model whose loss also goes through a parameter outside it (a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = net()
        self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))


class DiesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("OOM in backward")


def test_a_pass_dying_before_the_model_with_a_parameter_outside_it_is_refused() -> None:
    head = Head()
    params = [*head.body.parameters(), head.temperature]
    opt = Accumulate(torch.optim.SGD(params, lr=0.1), every=2, model=head.body)
    out = DiesInBackward.apply(head.body(X[:5]))
    with pytest.raises(RuntimeError, match="OOM in backward"):
        (((out - Y[:5]) ** 2).sum() * head.temperature).backward()
    assert head.temperature.grad is not None  # written before the pass died
    with pytest.raises(RuntimeError, match="failed part-way"):
        opt.step()
    opt.discard()
    assert head.temperature.grad is None


def test_a_pass_reaching_only_a_parameter_outside_the_model_is_counted() -> None:
    head = Head()
    params = [*head.body.parameters(), head.temperature]
    opt = Accumulate(torch.optim.SGD(params, lr=0.1), every=2, model=head.body)
    (head.temperature**2).backward()
    assert opt.micro_step == 1


def test_apply_under_accumulate_is_one_micro_step_per_call() -> None:
    """Each call of an ``accumopt.apply`` function (micro-batches of 4 rows) is one micro-step
    of the window, however many micro-batches it runs; a call that raises part-way leaves the
    wrapper refusing until discard()."""
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)

    @accumopt.apply(["x", "y"], 4)
    def mean_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(x) == 3:
            raise RuntimeError("injected in the last micro-batch")
        return ((model(x) - y) ** 2).mean()

    with pytest.raises(RuntimeError, match="injected"):
        mean_loss(x=X[:11], y=Y[:11])  # micro-batches 4 + 4 + 3: the last one raises
    with pytest.raises(RuntimeError, match="failed part-way"):
        opt.step()
    opt.discard()
    for a, b in [(0, 10), (10, 18), (18, 24), (0, 8)]:
        mean_loss(x=X[a:b], y=Y[a:b])
        opt.step()
        opt.zero_grad()
    assert opt.updates == 2
    # each call's loss is its batch's mean; the window is the mean of the two calls
    model_ref = net()
    ref = torch.optim.SGD(model_ref.parameters(), lr=0.1)
    for window in ([(0, 10), (10, 18)], [(18, 24), (0, 8)]):
        ref.zero_grad()
        means = [((model_ref(X[a:b]) - Y[a:b]) ** 2).mean() for a, b in window]
        (sum(means) / 2).backward()
        ref.step()
    assert_matches(model, [p.detach() for p in model_ref.parameters()])


def test_runner_with_an_empty_micro_batch_leaves_unused_parameters_alone() -> None:
    """AdamW moves a parameter whose gradient is 0 (weight decay, momentum) but not one whose
    gradient is None: a micro-batch of no items must write no gradient."""
    model, spare = net(), nn.Parameter(torch.ones(2, dtype=torch.float64))

    def make(p: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=0.1, weight_decay=0.5)

    opt = Accumulate(make([*model.parameters(), spare]), every_items=12)

    def loss_fn(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        keep = rows[rows >= 0]
        return ((model(X[keep]) - Y[keep]) ** 2).sum() / max(len(keep), 1), len(keep)

    runner = MicroBatchRunner(opt, loss_fn, micro_batch_size=4, loss_reduction="mean")
    runner(torch.tensor([0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7, 8, 9, 10, 11]))
    assert opt.updates == 1
    assert_matches(model, reference([[(0, 12)]], make))
    assert spare.grad is None and torch.equal(spare, torch.ones(2, dtype=torch.float64))


def test_runner_auto_interrupted_in_a_micro_batch_restores_its_buffers() -> None:
    """Ctrl-C (KeyboardInterrupt) in a micro-batch's loss_fn, after its forward pass moved the
    BatchNorm statistics: the attempt is undone as for any other error, then re-raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=24, model=model)
    calls = [0]

    def loss_fn(rows: torch.Tensor) -> torch.Tensor:
        loss = ((model(X[rows]) - Y[rows]) ** 2).sum()
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return loss

    runner = MicroBatchRunner(opt, loss_fn, start_size=8, loss_reduction="sum")
    runner(torch.arange(8))
    stats = copy.deepcopy(model[1].state_dict())
    with pytest.raises(KeyboardInterrupt):
        runner(torch.arange(8, 16))
    for name, value in model[1].state_dict().items():
        assert torch.equal(value, stats[name]), name


def test_runner_calls_spanning_windows_step_a_scheduler_once_per_update() -> None:
    """One runner call may apply several updates or none, so ``did_update`` after it does not
    count them: a per-update scheduler is stepped by a post-step hook on the inner optimizer
    (README, MicroBatchRunner), and every window gets its own learning rate."""
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.optimizer.register_step_post_hook(lambda *_: sched.step())
    runner = MicroBatchRunner(
        opt,
        lambda rows: loss_of(model, rows[0], rows[-1] + 1),
        micro_batch_size=3,
        loss_reduction="sum",
    )
    for a in (0, 11):  # two calls: updates after rows 5, 10, 15, 20 (two in each call)
        runner(torch.arange(a, a + 11))
    assert opt.updates == sched.last_epoch == 4
    ref = net()
    for k, a in enumerate(range(0, 20, 5)):
        ref.zero_grad()
        (loss_of(ref, a, a + 5) / 5).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * 0.5**k * p.grad
    assert_matches(model, [p.detach() for p in ref.parameters()])


@pytest.mark.parametrize("loop", ["runner", "plain loop"])
@pytest.mark.parametrize("retry", ["step", "none"])
def test_a_step_that_raises_after_its_update_leaves_no_gradient_for_the_next_window(
    loop: str, retry: str
) -> None:
    """A post-step hook raises once, after the update of window 1: the caller's zero_grad()
    never runs (the runner's own call raised between its step() and zero_grad()). The spent
    window's gradient was left in .grad, and window 2 added up on top of it, silently (rel
    0.014 with the runner; found by the fault sweep). Whether the next micro-batch comes first
    or the caller's retry: the window was finished with .grad cleared, and every window is
    exact."""
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=6)
    fail = RaiseOnce(lambda *_: None, RuntimeError("injected"))
    opt.optimizer.register_step_post_hook(fail)
    runner = MicroBatchRunner(
        opt,
        lambda rows: loss_of(model, rows[0], rows[-1] + 1),
        micro_batch_size=4,
        loss_reduction="sum",
    )
    for a in range(0, 18, 6):  # three windows of 6 rows
        try:
            if loop == "runner":
                runner(torch.arange(a, a + 6))
            else:
                for b in range(a, a + 6, 3):
                    micro_step(opt, model, b, b + 3)
        except RuntimeError as err:
            assert str(err) == "injected" and opt.updates == 1 and a == 0
            assert all(p.grad is None for p in model.parameters())
            if retry == "step":  # a retried step(): nothing to step
                with pytest.raises(RuntimeError, match="no backward pass since the last step"):
                    opt.step()
    assert opt.updates == 3
    assert_matches(model, reference([[(a, a + 6)] for a in range(0, 18, 6)]))


def test_the_auto_runner_refuses_a_closed_window_before_it_tries_a_size() -> None:
    """A closed window waiting for step(): an "auto" runner call whose first attempt ran out of
    memory said "drop_micro_step: the window is complete", from its out-of-memory recovery
    (found by review); it is refused at once, and opt.step() then finishes the window."""
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=6)
    opt.backward(loss_of(model, 0, 6), items=6)
    assert opt.will_update
    with simulate_oom(model, 2), pytest.raises(RuntimeError, match="complete"):
        MicroBatchRunner(
            opt, lambda rows: loss_of(model, rows[0], rows[-1] + 1), loss_reduction="sum"
        )(torch.arange(6, 12))
    opt.step()
    opt.zero_grad()
    MicroBatchRunner(opt, lambda rows: loss_of(model, rows[0], rows[-1] + 1), loss_reduction="sum")(
        torch.arange(6, 12)
    )
    assert opt.updates == 2
    assert_matches(model, reference([[(0, 6)], [(6, 12)]]))


def test_fractional_items_close_the_window_at_their_total_despite_rounding() -> None:
    """Ten items of 0.1 sum to 0.9999999999999999 in float64: the window of 1.0 item closes at
    the tenth micro-step, not at an eleventh; whole items still close exactly at the size."""
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=1.0)
    for i in range(10):
        assert opt.updates == 0
        opt.backward(loss_of(model, 2 * i, 2 * i + 2), items=0.1)
        opt.step()
        opt.zero_grad()
    assert opt.updates == 1 and opt.micro_step == 0
    big_model = net()
    big = Accumulate(torch.optim.SGD(big_model.parameters(), lr=0.1), every_items=10**9)
    big.backward(loss_of(big_model, 0, 2), items=10**9 - 1)
    big.step()
    assert not big.will_update
    big.backward(loss_of(big_model, 2, 4), items=1)
    assert big.will_update


def test_apply_groups_passes_whose_end_runs_on_another_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Autograd runs the end-of-pass callbacks of a CUDA graph on its device thread, not the
    caller's: a call's passes are grouped there too (emulated on CPU by ending each pass on a
    second thread, as the engine does)."""
    original = Accumulate._end_pass

    def on_another_thread(self: Any, *args: Any) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                original(self, *args)
            except BaseException as err:  # handed back to the caller's thread
                errors.append(err)

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        if errors:
            raise errors[0]

    monkeypatch.setattr(Accumulate, "_end_pass", on_another_thread)
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)

    @accumopt.apply(["x", "y"], 4)
    def mean_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((model(x) - y) ** 2).mean()

    mean_loss(x=X[:10], y=Y[:10])
    assert opt.micro_step == 1 and opt.updates == 0


def test_apply_with_two_wrappers_whose_first_refuses_leaves_the_second_refusing() -> None:
    """Two wrappers over two halves of a model, one call: when the first one's count raises (a
    micro-step hook that refuses the batch), the second, whose .grad holds the same batch,
    refuses until discard() instead of keeping it for its next window."""
    model = net()
    first = Accumulate(torch.optim.SGD(model[2].parameters(), lr=0.1), every=2)
    second = Accumulate(torch.optim.SGD(model[0].parameters(), lr=0.1), every=2)

    def refuse(*_: Any) -> None:
        raise FloatingPointError("refused by a micro-step hook")

    first.register_micro_step_hook(refuse)

    @accumopt.apply(["x", "y"], 4)
    def mean_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((model(x) - y) ** 2).mean()

    with pytest.raises(FloatingPointError):
        mean_loss(x=X[:10], y=Y[:10])
    for opt in (first, second):
        with pytest.raises(RuntimeError, match="failed part-way"):
            opt.step()
    second.discard()
    assert all(p.grad is None for p in model[0].parameters())


def test_apply_refuses_an_item_count_for_its_passes() -> None:
    """The decorated function returns a mean loss, so a call is one unweighted micro-step: a
    pass given items (``opt.next_items``) is refused, not counted with a wrong weight."""
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)

    @accumopt.apply(["x", "y"], 4)
    def mean_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.next_items(len(x))
        return ((model(x) - y) ** 2).mean()

    with pytest.raises(ValueError, match="item count"):
        mean_loss(x=X[:8], y=Y[:8])
    opt.discard()
    assert opt.micro_step == 0 and all(p.grad is None for p in model.parameters())


def test_apply_called_on_a_worker_thread_is_one_micro_step_of_the_main_threads_wrapper() -> None:
    """The wrapper steps on the main thread, each call runs on a worker (a thread pool): each
    call is still one micro-step, and ``opt.zero_grad()`` inside a call wipes nothing."""
    from concurrent.futures import ThreadPoolExecutor

    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)

    @accumopt.apply(["x", "y"], 2)
    def mean_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()  # a no-op while the call's first pass waits to be counted
        return ((model(x) - y) ** 2).mean()

    calls = [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24)]
    with ThreadPoolExecutor(1) as pool:
        for a, b in calls:
            pool.submit(lambda a=a, b=b: mean_loss(x=X[a:b], y=Y[a:b])).result()
            opt.step()
            opt.zero_grad()
    assert opt.updates == 2
    ref = net()
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for window in (calls[:3], calls[3:]):
        sgd.zero_grad()
        (sum(((ref(X[a:b]) - Y[a:b]) ** 2).mean() for a, b in window) / 3).backward()
        sgd.step()
    assert_matches(model, [p.detach() for p in ref.parameters()])


def test_apply_leaves_another_threads_wrapper_alone() -> None:
    """A wrapper first stepped from another thread is that thread's: its passes during this
    thread's call are its own micro-steps (two of them here, PyTorch's gated recipe)."""
    model, other = net(), net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    theirs = Accumulate(torch.optim.SGD(other.parameters(), lr=0.1), every=4)

    def their_passes(count: int) -> None:
        for i in range(count):
            loss_of(other, 2 * i, 2 * i + 2).backward()
        if count == 1:
            theirs.step()  # their wrapper's first step: from their thread

    first = threading.Thread(target=their_passes, args=(1,))
    first.start()
    first.join()
    second = threading.Thread(target=their_passes, args=(2,))

    @accumopt.apply(["x", "y"], 4)
    def mean_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if second.ident is None:  # their two passes while this call runs
            second.start()
            second.join()
        return ((model(x) - y) ** 2).mean()

    mean_loss(x=X[:8], y=Y[:8])
    assert opt.micro_step == 1 and theirs.micro_step == 3


def test_a_window_saved_before_scaler_step_resumes_under_a_fresh_scaler() -> None:
    """Saved after the window's first ``scaler.scale(loss).backward()`` and before its
    ``scaler.step(opt)``, loaded into a fresh wrapper and GradScaler (whose scale is made
    lazily, after the load), resumed with the next micro-batch and ``scaler.step`` after each:
    the fold at ``scaler.step`` is not taken for a wipe of the loaded window, and the run ends
    where the uninterrupted one does."""

    def build() -> tuple[nn.Module, Accumulate, torch.amp.GradScaler]:
        model, scaler = net(), torch.amp.GradScaler("cpu", init_scale=16.0)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, Accumulate(inner, every=3, scaler=scaler), scaler

    def micro_batch(model: nn.Module, opt: Accumulate, scaler: Any, i: int, step: bool) -> None:
        scaler.scale(loss_of(model, 3 * i, 3 * i + 3)).backward()
        if step:
            scaler.step(opt)
            scaler.update()

    model, opt, scaler = build()
    for i in range(3):
        micro_batch(model, opt, scaler, i, step=True)
    expected = [p.detach().clone() for p in model.parameters()]
    model, opt, scaler = build()
    micro_batch(model, opt, scaler, 0, step=False)
    saved = copy.deepcopy(
        {"m": model.state_dict(), "o": opt.state_dict(), "s": scaler.state_dict()}
    )
    model, opt, scaler = build()
    model.load_state_dict(saved["m"])
    opt.load_state_dict(saved["o"])
    scaler.load_state_dict(saved["s"])
    for i in (1, 2):
        micro_batch(model, opt, scaler, i, step=True)
    assert opt.updates == 1
    assert_matches(model, expected)

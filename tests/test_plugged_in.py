"""Issue 12 in accumopt's own loop: the torch.optim contract in full, and every way the window
can be corrupted from outside the wrapper either exact or refused before the first wrong update.

Each test is named after the path a user takes: the loops people write when they move from a
hand-written accumulation loop, and what frameworks do to an optimizer they are handed.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from helpers import assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accumopt import Accumulate, MicroBatchRunner

SIZES = [3, 1, 4]  # a ragged window of 8 rows


def windows(acc: Accumulate, model: nn.Module, seed: int, n: int = 2) -> None:
    for w in range(n):
        x, y = data(seed + w, sum(SIZES))
        for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            acc.zero_grad()


def reference(ref: nn.Module, seed: int, n: int = 2, lr: float = 0.1) -> None:
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for w in range(n):
        full_batch_step(ref, opt, *data(seed + w, sum(SIZES)))


def gated_windows(
    acc: Accumulate, sched: Any, model: nn.Module, reference: tuple[Any, Any, Any], seed: int
) -> None:
    """Three windows of ``SIZES`` rows with ``sched`` stepped on real updates only, and the same
    windows as full-batch steps of ``reference`` (model, optimizer, scheduler stepped after
    each)."""
    ref, ref_opt, ref_sched = reference
    for w in range(3):
        x, y = data(seed + w, 8)
        for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            if acc.did_update:
                sched.step()
            acc.zero_grad()
        full_batch_step(ref, ref_opt, x, y)
        ref_sched.step()


def scheduler_every_micro_step(
    acc: Accumulate, sched: Any, model: nn.Module, x: Any, y: Any, before: list[Any]
) -> None:
    """The mistake: ``sched.step()`` after every micro-step of one window of ``SIZES`` rows;
    raises at the boundary with the window closed and the parameters as ``before``."""
    try:
        for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            sched.step()
    finally:
        assert acc.updates == 0 and acc.will_update
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------- the torch.optim contract


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_step_with_a_closure_is_called_once_and_is_exact(sizes: list[int]) -> None:
    """Lightning's path: optimizer.step(closure) with the forward and backward inside."""
    ref, model = twins(mlp(71))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=len(sizes))
    x, y = data(71, sum(sizes))
    for i, (xb, yb) in enumerate(zip(x.split(sizes), y.split(sizes))):
        losses: list[torch.Tensor] = []

        def closure(
            xb: torch.Tensor = xb, yb: torch.Tensor = yb, losses: list[torch.Tensor] = losses
        ) -> torch.Tensor:
            acc.zero_grad()
            loss = mse_sum(model, xb, yb)
            acc.next_items(len(xb))
            loss.backward()
            losses.append(loss)
            return loss

        with torch.no_grad():  # step() turns autograd on for the closure
            returned = acc.step(closure)
        assert len(losses) == 1 and returned is losses[0]
        assert acc.did_update == (i == len(sizes) - 1)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    assert_same_params(model, ref)


def test_next_items_weights_a_backward_pass_accumopt_does_not_run() -> None:
    ref, model = twins(mlp(72))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    for w in range(2):
        x, y = data(72 + w, 8)
        for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
            acc.next_items(torch.tensor(len(xb)))
            mse_sum(model, xb, yb).backward()
            acc.step()
            acc.zero_grad()
        assert acc.did_update
    reference(ref, 72)
    assert_same_params(model, ref)


def test_next_items_twice_before_a_backward_pass_is_refused_and_changes_nothing() -> None:
    acc = Accumulate(torch.optim.SGD(mlp(73).parameters(), lr=0.1), every=2)
    acc.next_items(3)
    with pytest.raises(ValueError, match=r"next_items\(3\) is still waiting"):
        acc.next_items(4)
    with pytest.raises(ValueError, match="still waiting"):
        acc.backward(mse_sum(mlp(73), *data(73, 2)), items=2)
    with pytest.raises(ValueError, match="items=None"):
        acc.next_items(None)  # type: ignore[arg-type]
    assert acc.micro_step == 0


def test_discard_drops_a_waiting_item_count_with_the_window() -> None:
    """A micro-batch whose forward pass failed after ``next_items(n)`` (an OOM, say) is
    retried with another count after ``discard()``: the waiting count went with the window,
    and the window trains exactly on what came after."""
    ref, model = twins(mlp(75))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    acc.next_items(5)  # its forward pass fails: no backward pass comes
    acc.discard()
    x, y = data(75, 8)
    for xb, yb in zip(x.split(4), y.split(4)):
        acc.next_items(len(xb))
        mse_sum(model, xb, yb).backward()
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    assert_same_params(model, ref)


def test_last_window_reports_micro_steps_items_and_the_pre_clip_norm() -> None:
    ref, model = twins(mlp(74))
    x, y = data(74, 8)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (mse_sum(ref, x, y) / 8).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    ref_opt.step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, max_grad_norm=0.01)
    assert acc.last_window is None
    windows(acc, model, 74, n=1)
    report = acc.last_window
    assert report is not None and report.updated
    assert (report.micro_steps, report.items) == (3, 8.0)
    assert report.grad_norm is not None
    torch.testing.assert_close(report.grad_norm, ref_norm)
    assert_same_params(model, ref)


def test_max_grad_norm_inf_measures_the_norm_without_clipping() -> None:
    ref, model = twins(mlp(75))
    acc = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1), every=3, max_grad_norm=float("inf")
    )
    windows(acc, model, 75, n=1)
    reference(ref, 75, n=1)
    assert_same_params(model, ref)
    report = acc.last_window
    assert report is not None and report.grad_norm is not None and report.grad_norm > 0


def test_a_skipped_window_is_reported_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp(76)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    with caplog.at_level(logging.INFO, logger="accumopt"):
        for _ in range(2):
            acc.backward(mse_sum(model, *data(76, 2)) * 0, items=0)
            acc.step()
    assert acc.last_window is not None and not acc.last_window.updated
    assert any("skipped" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------ gradients wiped or replaced mid-window


def wipe_model_zero_grad(model: nn.Module, acc: Accumulate) -> None:
    model.zero_grad()


def wipe_inner_zero_grad(model: nn.Module, acc: Accumulate) -> None:
    acc.optimizer.zero_grad()


def wipe_grad_none(model: nn.Module, acc: Accumulate) -> None:
    next(iter(model.parameters())).grad = None


def wipe_in_place(model: nn.Module, acc: Accumulate) -> None:
    model.zero_grad(set_to_none=False)


def replace_grad(model: nn.Module, acc: Accumulate) -> None:
    p = next(iter(model.parameters()))
    assert p.grad is not None
    p.grad = p.grad.clone()


WIPES = [wipe_model_zero_grad, wipe_inner_zero_grad, wipe_grad_none, wipe_in_place, replace_grad]


@pytest.mark.parametrize("wipe", WIPES)
@pytest.mark.parametrize("where", [0, 1])  # after the first micro-step, after the second
def test_own_loop_gradients_wiped_mid_window_are_refused_before_the_update(
    wipe: object, where: int
) -> None:
    model = mlp(77)
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    x, y = data(77, 8)
    with pytest.raises(RuntimeError, match="replaced or cleared by code outside"):
        for i, (xb, yb) in enumerate(zip(x.split(SIZES), y.split(SIZES))):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            if i == where:
                wipe(model, acc)  # type: ignore[operator]
    assert acc.updates == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="cleared or replaced outside the wrapper"):
        acc.step()
    acc.discard()  # the way out: the next window trains normally
    ref, fresh = twins(model)
    windows(acc, model, 78, n=1)
    reference(ref, 78, n=1)
    assert_same_params(model, ref)
    del fresh


def test_own_loop_flush_of_a_wiped_window_is_refused() -> None:
    model = mlp(79)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    parts = list(zip(*(t.split(2) for t in data(79, 4))))
    acc.backward(mse_sum(model, *parts[0]), items=2)
    acc.step()
    model.zero_grad()  # every micro-step: caught at the next one, before any flush
    with pytest.raises(RuntimeError, match="replaced or cleared"):
        acc.backward(mse_sum(model, *parts[1]), items=2)
    with pytest.raises(RuntimeError, match="cleared or replaced outside the wrapper"):
        acc.flush()
    assert acc.updates == 0


def test_own_loop_a_wipe_of_a_copied_window_is_refused() -> None:
    """A window copied mid-way (``copy.deepcopy`` of the model and the wrapper together) has
    its ``.grad`` noted again: a wipe of the copy is refused at its close (rel 0.03 before)."""
    model = mlp(80)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    parts = list(zip(*(t.split(2) for t in data(80, 8))))
    for xb, yb in parts[:2]:
        acc.backward(mse_sum(model, xb, yb), items=2)
        acc.step()
    model, acc = copy.deepcopy((model, acc))
    model.zero_grad()
    with pytest.raises(RuntimeError, match="replaced or cleared"):
        for xb, yb in parts[2:]:
            acc.backward(mse_sum(model, xb, yb), items=2)
            acc.step()
    assert acc.updates == 0


def test_create_graph_accumulation_out_of_place_is_not_a_wipe() -> None:
    """Under create_graph=True torch accumulates out of place (.grad is a new tensor with a
    history): that is accumulation, not a wipe."""
    ref, model = twins(mlp(80))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    x, y = data(80, 8)
    for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
        acc.backward(mse_sum(model, xb, yb), items=len(xb), create_graph=True)
        acc.step()
        acc.zero_grad()
    assert acc.did_update
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    assert_same_params(model, ref)


# --------------------------------------------------------------- migration mistakes


def test_own_loop_scheduler_stepped_every_micro_step_is_refused_at_the_boundary() -> None:
    model = mlp(81)
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=3)
    sched = torch.optim.lr_scheduler.StepLR(acc, step_size=1, gamma=0.5)
    fresh = sched.state_dict()
    x, y = data(81, 8)
    with pytest.raises(RuntimeError, match="learning rate of param group 0 changed"):
        scheduler_every_micro_step(acc, sched, model, x, y, before)
    sched.load_state_dict(fresh)  # the way on, as the message says
    acc.param_groups[0]["lr"] = 0.5
    acc.discard()
    ref = mlp(81)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    gated_windows(acc, sched, model, (ref, ref_opt, ref_sched), seed=82)
    assert acc.updates == 3
    assert_same_params(model, ref)


@pytest.mark.parametrize("inner", [torch.optim.SGD, torch.optim.Adam])
def test_a_tensor_learning_rate_changed_in_place_inside_the_window_is_refused(inner: Any) -> None:
    """Schedulers change a tensor rate in place (``fill_``): the same object comes back, so the
    guard notes its version and value, not only its identity."""
    model = mlp(83)
    before = [p.detach().clone() for p in model.parameters()]
    acc = Accumulate(inner(model.parameters(), lr=torch.tensor(0.5, dtype=torch.float64)), every=3)
    sched = torch.optim.lr_scheduler.LambdaLR(acc, lambda t: 1 / (1 + t))
    x, y = data(83, 8)
    with pytest.raises(RuntimeError, match=r"param group 0 changed .*from 0\.5 to 0\.1666"):
        scheduler_every_micro_step(acc, sched, model, x, y, before)
    acc.param_groups[0]["lr"].fill_(0.5)  # set back: the window applies, exact
    acc.step()
    ref = mlp(83)
    full_batch_step(ref, inner(ref.parameters(), lr=0.5), x, y)
    assert_same_params(model, ref)


def test_a_tensor_learning_rate_refilled_with_its_value_inside_the_window_is_allowed() -> None:
    ref, model = twins(mlp(84))
    lr = torch.tensor(0.5, dtype=torch.float64)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=lr), every=3)
    windows(acc, model, seed=84)
    x, y = data(84, 8)
    for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
        acc.backward(mse_sum(model, xb, yb), items=len(xb))
        lr.fill_(0.5)  # a constant schedule stepped every micro-step: harmless
        acc.step()
        acc.zero_grad()
    assert acc.updates == 3
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for w in range(2):
        full_batch_step(ref, opt, *data(84 + w, 8))
    full_batch_step(ref, opt, x, y)
    assert_same_params(model, ref)


@pytest.mark.parametrize("rate", [float, lambda v: torch.tensor(v, dtype=torch.float64)])
def test_a_learning_rate_set_after_the_closing_pass_is_the_updates_own(rate: Any) -> None:
    """The hand loop's ``if boundary: set the rate; opt.step()``: once the window closed
    (``opt.will_update``), a rate set before ``step()`` is the update's, as in that loop."""
    ref, model = twins(mlp(85))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=rate(0.5)), every=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for w in range(3):
        x, y = data(85 + w, 8)
        for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            if acc.will_update:
                acc.param_groups[0]["lr"] = rate(0.5 / (w + 2))
            acc.step()
            acc.zero_grad()
        ref_opt.param_groups[0]["lr"] = 0.5 / (w + 2)
        full_batch_step(ref, ref_opt, x, y)
    assert acc.updates == 3
    assert_same_params(model, ref)


def test_own_loop_scheduler_stepped_several_times_between_windows_is_allowed() -> None:
    """Stepping between windows is the caller's business (Accelerate steps once per process
    after each update); an epoch-level scheduler stepped after the epoch's flush() is exact."""
    ref, model = twins(mlp(85))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=3)
    sched = torch.optim.lr_scheduler.StepLR(acc, step_size=2, gamma=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for w in range(3):
        x, y = data(85 + w, 12)
        for xb, yb in zip(x.split(4), y.split(4)):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            acc.zero_grad()
        sched.step()
        sched.step()  # twice per update: the schedule's own unit
        full_batch_step(ref, ref_opt, x, y)
        ref_sched.step()
    assert_same_params(model, ref)
    x, y = data(90, 8)  # an epoch of 2 micro-batches: the window is open at its end
    for xb, yb in zip(x.split(4), y.split(4)):
        acc.backward(mse_sum(model, xb, yb), items=len(xb))
        acc.step()
        acc.zero_grad()
    assert acc.flush()  # the epoch's short window first, then its scheduler step
    sched.step()
    full_batch_step(ref, ref_opt, x, y)
    assert_same_params(model, ref)


def test_own_loop_resumed_scheduler_stepped_on_real_updates_is_exact() -> None:
    """A scheduler whose state is loaded after construction (a resumed run: _step_count > 1),
    stepped when opt.did_update: exact, and a copy of the wrapper leaves its patched step
    behind."""
    ref, model = twins(mlp(86))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=4)
    sched = torch.optim.lr_scheduler.StepLR(acc, step_size=4, gamma=0.5)
    donor_opt = torch.optim.SGD(mlp(0).parameters(), lr=0.5)
    donor = torch.optim.lr_scheduler.StepLR(donor_opt, step_size=4, gamma=0.5)
    for _ in range(3):
        donor_opt.step()
        donor.step()
    saved = {**donor.state_dict(), "last_epoch": 0, "_last_lr": [0.5]}
    sched.load_state_dict(saved)  # _step_count 4: no handshake at its next step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5)
    for w in range(5):
        x, y = data(86 + w, 16)
        for xb, yb in zip(x.split(4), y.split(4)):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            if acc.did_update:
                sched.step()
            acc.zero_grad()
        full_batch_step(ref, ref_opt, x, y)
        ref_sched.step()
    assert acc.updates == 5 and sched.get_last_lr() == ref_sched.get_last_lr()
    assert_same_params(model, ref)
    clone = copy.deepcopy(acc)  # a copy leaves the scheduler's replaced step behind
    assert "step" not in clone.__dict__ and clone.step.__self__ is clone


def test_own_loop_scheduler_stepped_on_real_updates_is_exact() -> None:
    ref, model = twins(mlp(82))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=3)
    sched = torch.optim.lr_scheduler.StepLR(acc, step_size=1, gamma=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    gated_windows(acc, sched, model, (ref, ref_opt, ref_sched), seed=82)
    assert_same_params(model, ref)


def test_own_loop_inner_optimizer_stepped_directly_is_refused_at_the_first_call() -> None:
    model = mlp(83)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulate(inner, every=3)
    before = [p.detach().clone() for p in model.parameters()]
    mse_sum(model, *data(83, 2)).backward()
    with pytest.raises(RuntimeError, match="stepped directly"):
        inner.step()  # the mistake: the old optimizer object kept in the loop
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    del acc  # a dropped wrapper no longer guards the inner optimizer
    inner.step()


def test_own_loop_runner_auto_over_a_window_in_micro_steps_is_refused() -> None:
    model = mlp(84)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    with pytest.raises(ValueError, match="every_items"):
        MicroBatchRunner(
            acc, lambda b: mse_sum(model, *b), micro_batch_size="auto", loss_reduction="sum"
        )
    MicroBatchRunner(
        acc, lambda b: mse_sum(model, *b), micro_batch_size=4, loss_reduction="sum"
    )  # fixed: fine


# ------------------------------------------------------------------------- GradScaler paths


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def amp_loop(acc: Accumulate, model: nn.Module, sc: torch.amp.GradScaler, seed: int) -> None:
    for w in range(2):
        x, y = data(seed + w, 8)
        for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
            acc.backward(sc.scale(mse_sum(model, xb, yb)), items=len(xb))
            sc.step(acc)
            sc.update()
            acc.zero_grad()


def test_timm_style_scaler_step_without_scaler_argument_is_refused_then_exact_with_it() -> None:
    """timm's NativeScaler calls scaler.step(opt) every micro-step: each micro-step must be
    unscaled with its own loss scale, which needs the scaler (scaler=). Without it the first
    scaler.step inside the window is refused, nothing changed; with it the loop is exact."""
    model = mlp(85)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    sc = scaler()
    with pytest.raises(RuntimeError, match="without scaler="):
        amp_loop(acc, model, sc, 85)
    assert acc.micro_step == 1 and acc.updates == 0
    ref, model = twins(mlp(85))
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, scaler=sc)
    amp_loop(acc, model, sc, 85)
    assert acc.updates == 2
    reference(ref, 85)
    assert_same_params(model, ref)


def test_scaler_step_without_scaler_after_a_folded_micro_step_is_refused() -> None:
    model = mlp(86).to(torch.bfloat16)  # bf16 micro-steps are folded into float32 at once
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    x, y = data(86, 4)
    sc = scaler()
    for xb, yb in zip(x.split(2), y.split(2)):
        sc.scale(mse_sum(model, xb.bfloat16(), yb.bfloat16()).float()).backward()
    with pytest.raises(RuntimeError, match="without scaler="):
        sc.step(acc)


def test_timm_style_unscale_and_clip_every_micro_step_is_refused() -> None:
    model = mlp(87)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, scaler=sc)
    x, y = data(87, 8)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"unscale_\(opt\) ran inside an open window"):
        for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
            acc.backward(sc.scale(mse_sum(model, xb, yb)), items=len(xb))
            sc.unscale_(acc)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # a partial sum
            sc.step(acc)
            sc.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="unscale_"):
        acc.backward(mse_sum(model, x, y), items=8)
    acc.discard()


def test_unscale_at_the_boundary_only_is_exact() -> None:
    ref, model = twins(mlp(88))
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, scaler=sc)
    x, y = data(88, 8)
    for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
        acc.backward(sc.scale(mse_sum(model, xb, yb)), items=len(xb))
        if acc.will_update:
            sc.unscale_(acc)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        sc.step(acc)
        sc.update()
    assert acc.did_update
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    assert_same_params(model, ref)


# --------------------------------------------------------------------------- set_model


def test_set_model_between_windows_counts_at_the_model_and_is_exact() -> None:
    ref, model = twins(mlp(89))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    acc.set_model(model)
    assert acc.model is model
    windows(acc, model, 89)
    reference(ref, 89)
    assert_same_params(model, ref)


def test_set_model_inside_a_window_is_refused_and_changes_nothing() -> None:
    model = mlp(90)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    acc.backward(mse_sum(model, *data(90, 2)), items=2)
    with pytest.raises(RuntimeError, match="between windows"):
        acc.set_model(model)
    with pytest.raises(ValueError, match="holds none of the optimizer's parameters"):
        Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3).set_model(mlp(1))
    assert acc.model is None and acc.micro_step == 1


def test_a_dropped_wrapper_is_freed_at_once_and_stops_counting() -> None:
    """No reference cycle keeps a wrapper alive: dropped, it is freed without a garbage
    collection, its hooks go with it, and a new wrapper over the same parameters counts."""
    import weakref

    model = mlp(92)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2, scaler=sc)
    amp_loop(acc, model, sc, 92)
    dead = weakref.ref(acc)
    del acc
    assert dead() is None  # no garbage collection needed
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    mse_sum(model, *data(92, 2)).backward()
    assert acc.micro_step == 1


def test_the_window_guard_keeps_no_gradient_of_a_finished_window_alive() -> None:
    """The guard notes the window's .grad tensors after its first micro-step; once the window
    is applied and zero_grad() ran, nothing of accumopt may hold them (a gradient copy)."""
    import weakref

    model = mlp(93)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    x, y = data(93, 4)
    refs = []
    for xb, yb in zip(x.split(2), y.split(2)):
        acc.backward(mse_sum(model, xb, yb), items=2)
        refs += [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    assert all(r() is None for r in refs)


def test_a_window_loaded_from_a_checkpoint_then_wiped_is_refused_at_the_next_pass() -> None:
    """A framework that zeroes .grad after restoring a checkpoint saved mid-window (Lightning
    does, at the start of a fit) wipes the loaded window: the next micro-step refuses it (it
    used to apply the rest of the window divided by all of its rows, silently)."""
    model = mlp(seed=0)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    x, y = data(1, 9)
    mse_sum(model, x[:3], y[:3]).backward()
    acc.step()
    saved = copy.deepcopy(acc.state_dict())
    resumed = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    del acc
    resumed.load_state_dict(saved)
    model.zero_grad()  # the framework's zeroing
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="replaced or cleared by code outside the wrapper"):
        mse_sum(model, x[3:6], y[3:6]).backward()  # in the pass's callback
    assert resumed.updates == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_resume_mid_window_with_a_scheduler_loaded_after_the_wrapper_is_exact(
    scheduler_first: bool,
) -> None:
    """The usual resume order (optimizer, then scheduler) from a checkpoint saved inside a
    window, the scheduler stepped at updates: exact. (The window guard noted the scheduler's
    position at the wrapper's load, before the scheduler's own, and refused the window.)"""
    x, y = data(2, 24)
    model, ref = twins(mlp(seed=3))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=4)
    sched = torch.optim.lr_scheduler.StepLR(acc, step_size=1, gamma=0.5)

    def micro_steps(opt: Accumulate, scheduler: Any, rows: range) -> None:
        for i in rows:
            mse_sum(model, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]).div(2).backward()
            opt.step()
            if opt.did_update:
                scheduler.step()
            opt.zero_grad()

    micro_steps(acc, sched, range(6))  # one update, then 2 micro-steps of the second window
    saved = copy.deepcopy((acc.state_dict(), sched.state_dict()))
    del acc, sched
    resumed = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=4)
    resumed_sched = torch.optim.lr_scheduler.StepLR(resumed, step_size=1, gamma=0.5)
    loads = [
        lambda: resumed.load_state_dict(saved[0]),
        lambda: resumed_sched.load_state_dict(saved[1]),
    ]
    for load in reversed(loads) if scheduler_first else loads:
        load()
    micro_steps(resumed, resumed_sched, range(6, 12))
    plain = torch.optim.SGD(ref.parameters(), lr=0.5)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    for w in range(3):
        rows = slice(8 * w, 8 * w + 8)
        plain.zero_grad()
        mse_sum(ref, x[rows], y[rows]).div(8).backward()
        plain.step()
        plain_sched.step()
    assert_same_params(model, ref)


def test_a_second_live_wrapper_over_the_same_parameters_is_named_in_the_refusal() -> None:
    """Two live wrappers over one model both count every backward pass and divide at their
    own close: refused before any update, and the refusal names that cause."""
    model = mlp(seed=0)
    first = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    second = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    x, y = data(1, 8)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="another live Accumulate over these parameters"):
        for i in range(4):
            mse_sum(model, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]).backward()
            second.step()
            second.zero_grad()
    assert first.updates == second.updates == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_flush_refused_for_a_changed_rate_leaves_a_scaled_window_to_apply_once() -> None:
    """``scaler=``'s window is in scaled units until flush() unscales it: a refusal (a rate
    changed inside it) used to come after the unscaling, and the retry unscaled it again."""
    ref, model = twins(mlp(86))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=8, scaler=scaler)
    x, y = data(86, 8)
    for xb, yb in zip(x.split(SIZES), y.split(SIZES)):  # 3 micro-steps: the window stays open
        acc.backward(scaler.scale(mse_sum(model, xb, yb)), items=len(xb))
        scaler.step(acc)
        scaler.update()
        acc.zero_grad()
    acc.param_groups[0]["lr"] = 0.25
    with pytest.raises(RuntimeError, match="learning rate of param group 0 changed"):
        acc.flush()
    acc.param_groups[0]["lr"] = 0.5  # set back, as the message says
    assert acc.flush()
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), x, y)
    assert_same_params(model, ref)


@pytest.mark.parametrize(
    ("dtype", "counts"), [(torch.float16, [1024, 1024, 1]), (torch.int64, [2**23 + 1] * 3)]
)
def test_tensor_item_counts_are_summed_exactly(dtype: torch.dtype, counts: list[int]) -> None:
    """Counts given as tensors were summed in their own dtype (float16: 2048 for 2049) or in
    float32 (int64 counts above 2**24); they are summed in float64 now, as numbers are."""
    model = mlp(87)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.0), every=len(counts))
    x, y = data(87, len(counts))
    for xb, yb, n in zip(x.split(1), y.split(1), counts):
        acc.backward(mse_sum(model, xb, yb), items=torch.tensor(n, dtype=dtype))
        acc.step()
        acc.zero_grad()
    assert acc.last_window is not None and acc.last_window.items == float(sum(counts))


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), "1"])
def test_max_grad_norm_set_between_steps_is_validated(bad: Any) -> None:
    acc = Accumulate(torch.optim.SGD(mlp(88).parameters(), lr=0.1), every=2, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        acc.max_grad_norm = bad
    assert acc.max_grad_norm == 1.0
    acc.max_grad_norm = None
    assert acc.max_grad_norm is None


def test_scaler_attributes_left_by_an_interrupted_step_are_dropped_at_the_next_pass() -> None:
    """GradScaler sets ``opt.grad_scale``/``opt.found_inf`` before ``opt.step()`` and deletes
    them after it returns: a KeyboardInterrupt on step()'s first or last line left them, and
    the next ``scaler.step(opt)`` multiplied the stale scale into its own (found by the
    interrupt-at-every-line sweep). The next pass drops them."""
    ref, model = twins(mlp(89))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=3, scaler=scaler)
    x, y = data(89, 8)
    for i, (xb, yb) in enumerate(zip(x.split(SIZES), y.split(SIZES))):
        acc.backward(scaler.scale(mse_sum(model, xb, yb)), items=len(xb))
        scaler.step(acc)
        if i == 0:  # what an interrupt at `return loss` leaves: the step done, these not deleted
            acc.grad_scale = scaler._get_scale_async()  # type: ignore[attr-defined]
            acc.found_inf = torch.zeros(())  # type: ignore[attr-defined]
        scaler.update()  # the loop caught the interrupt and goes on
        acc.zero_grad()
    assert acc.did_update
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), x, y)
    assert_same_params(model, ref)


@pytest.mark.parametrize("kind", ["micro_step", "window", "update"])
def test_a_hook_that_is_not_callable_is_refused_when_registered(kind: str) -> None:
    acc = Accumulate(torch.optim.SGD(mlp(93).parameters(), lr=0.1), every=2)
    with pytest.raises(TypeError, match=f"register_{kind}_hook: hook=5 is not callable"):
        getattr(acc, f"register_{kind}_hook")(5)


@pytest.mark.parametrize("bad", [{}, {"state": {}}, []])
def test_load_state_dict_of_something_else_gets_accumopts_error(bad: Any) -> None:
    acc = Accumulate(torch.optim.SGD(mlp(94).parameters(), lr=0.1), every=2)
    with pytest.raises(TypeError, match=r"Accumulate\.load_state_dict: got"):
        acc.load_state_dict(bad)
    assert acc.loadable(bad) is not None


def test_a_mid_window_checkpoint_of_another_dtype_is_refused_before_anything_changes() -> None:
    """A float64 model's open window loaded into the model in float32: loadable() said yes, and
    the load raised torch's dtype error after the inner optimizer's state was replaced (the
    wrapper BROKEN with no reason). It is refused first, nothing changed."""
    model = mlp(95)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), every=3)
    windows(acc, model, seed=95, n=1)
    x, y = data(96, 3)
    acc.backward(mse_sum(model, x, y), items=3)
    saved = copy.deepcopy(acc.state_dict())
    acc.discard()
    model.float()
    state_before = copy.deepcopy(acc.optimizer.state_dict())
    assert "float64 gradient for parameter 0" in (acc.loadable(saved) or "")
    with pytest.raises(ValueError, match=r"holds a torch\.float64 gradient for parameter 0"):
        acc.load_state_dict(saved)
    assert acc.optimizer.state_dict()["state"].keys() == state_before["state"].keys()
    assert acc.micro_step == 0 and acc.phase.value == "open"

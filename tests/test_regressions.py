"""Regression tests for faults found by reviewing the wrapper adversarially (one test each)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from torch import nn

from accumopt import Accumulate


def test_scheduler_built_after_load_state_dict_reaches_the_inner_optimizer() -> None:
    """torch's load_state_dict installs new containers on the inner: the wrapper follows."""
    ref, model = twins(mlp(50))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    acc.load_state_dict(copy.deepcopy(acc.state_dict()))
    assert acc.param_groups is acc.optimizer.param_groups and acc.state is acc.optimizer.state
    sched = torch.optim.lr_scheduler.StepLR(acc, step_size=1, gamma=0.5)
    for w in range(3):
        x, y = data(500 + w, 4)
        full_batch_step(ref, ref_opt, x, y)
        ref_sched.step()
        for xb, yb in zip(x.split(2), y.split(2)):
            (mse_sum(model, xb, yb) / 2).backward()
            acc.step()
            if acc.did_update:
                sched.step()
            acc.zero_grad()
    assert acc.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert_same_params(model, ref)


def test_state_dict_hooks_registered_on_the_wrapper_run() -> None:
    acc = Accumulate(torch.optim.SGD(mlp(51).parameters(), lr=0.1), every=2)
    calls: list[str] = []
    acc.register_state_dict_pre_hook(lambda opt: calls.append("sd_pre"))
    acc.register_state_dict_post_hook(lambda opt, sd: calls.append("sd_post"))
    acc.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("load_pre"))
    acc.register_load_state_dict_post_hook(lambda opt: calls.append("load_post"))
    acc.load_state_dict(acc.state_dict())
    assert calls == ["sd_pre", "sd_post", "load_pre", "load_post"]


def test_rejected_scaler_step_leaves_no_stale_loss_scale() -> None:
    ref, model = twins(mlp(52))
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2, scaler=sc)
    sc.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="no backward pass"):
        sc.step(acc)
    assert "grad_scale" not in acc.__dict__ and "found_inf" not in acc.__dict__
    sc = torch.amp.GradScaler("cpu", init_scale=256.0)
    acc.scaler = sc
    x, y = data(52, 4)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    for xb, yb in zip(x.split(2), y.split(2)):
        sc.scale(mse_sum(model, xb, yb) / 2).backward()
        sc.step(acc)
        sc.update()
    assert acc.did_update
    assert_same_params(model, ref)


@pytest.mark.parametrize("given", [False, True])
def test_ddp_default_settings_keep_the_window_division(tmp_path: object, given: bool) -> None:
    """DDP copies reduced buckets into .grad in its own end-of-backward callback; the window's
    division must come after it (one-process gloo group, default DDP settings), whether the
    wrapper knows the DDP model or not."""
    store = dist.FileStore(str(tmp_path) + "/store", 1)  # type: ignore[operator]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ref, model = twins(mlp(53))
        ddp = nn.parallel.DistributedDataParallel(model)
        x, y = data(53, 8)
        full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
        acc = Accumulate(
            torch.optim.SGD(ddp.parameters(), lr=0.1), every=3, model=ddp if given else None
        )
        for xb, yb in zip(x.split([3, 3, 2]), y.split([3, 3, 2])):
            acc.backward(mse_sum(ddp, xb, yb), items=len(xb))
            acc.step()
            acc.zero_grad()
        assert acc.updates == 1
        assert_same_params(model, ref)
    finally:
        dist.destroy_process_group()


def test_lazy_parameters_are_refused_with_a_clear_error() -> None:
    model = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(TypeError, match="uninitialized lazy parameters"):
        Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)


@pytest.mark.parametrize("loss", [None, 3.0, torch.ones(2, requires_grad=True)])
def test_backward_of_a_non_scalar_or_non_tensor_is_a_type_error(loss: object) -> None:
    acc = Accumulate(torch.optim.SGD(mlp(54).parameters(), lr=0.1), every=2)
    with pytest.raises(TypeError, match="expected a one-element tensor"):
        acc.backward(loss, items=1)  # type: ignore[arg-type]


def test_load_state_dict_of_a_non_dict_is_a_type_error() -> None:
    acc = Accumulate(torch.optim.SGD(mlp(55).parameters(), lr=0.1), every=2)
    with pytest.raises(TypeError, match="expected the dict returned by state_dict"):
        acc.load_state_dict(None)  # type: ignore[arg-type]


def test_parameters_frozen_at_construction_are_counted_after_unfreezing() -> None:
    ref, model = twins(mlp(56))
    for p in model.parameters():
        p.requires_grad_(False)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    for p in model.parameters():
        p.requires_grad_(True)
    acc.zero_grad()  # the loop's zero_grad before the first window picks them up
    x, y = data(56, 4)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    for xb, yb in zip(x.split(2), y.split(2)):
        (mse_sum(model, xb, yb) / 2).backward()
        acc.step()
        acc.zero_grad()
    assert_same_params(model, ref)


def test_rebuilding_the_wrapper_mid_window_leaves_the_new_one_exact() -> None:
    """Re-running `opt = Accumulate(...)` (a notebook cell) must not leave the old wrapper
    counting and dividing the shared .grad until the next garbage collection."""
    ref, model = twins(mlp(57))
    x, y = data(57, 8)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    (mse_sum(model, x[:2], y[:2]) / 2).backward()
    opt.step()
    opt.discard()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    for xb, yb in zip(x.split(2), y.split(2)):
        (mse_sum(model, xb, yb) / 2).backward()
        opt.step()
        opt.zero_grad()
    assert opt.updates == 1
    assert_same_params(model, ref)


def test_gated_amp_recipe_with_skip_window_keeps_training() -> None:
    """PyTorch's gated AMP recipe with ``nonfinite="skip_window"``: the window with a bad
    micro-batch is skipped once, and every later window updates."""
    torch.manual_seed(58)
    model = nn.Linear(3, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1),
        every=2,
        scaler=scaler,
        nonfinite="skip_window",
    )
    for i in range(8):
        x = torch.randn(4, 3)
        if i == 1:
            x[0, 0] = float("inf")
        scaler.scale(model(x).pow(2).mean()).backward()
        if opt.will_update:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    assert opt.updates == 3 and opt.micro_step == 0  # the window with the inf was skipped


def test_drop_micro_step_refuses_when_finished_micro_steps_are_in_grad() -> None:
    model = mlp(59)
    scaler = torch.amp.GradScaler("cpu")
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1), every=3, scaler=scaler, buffer=True
    )
    x, y = data(59, 2)
    scaler.scale(mse_sum(model, x, y)).backward()  # gated recipe: no scaler.step yet
    with pytest.raises(RuntimeError, match=r"scaler.step\(opt\) after every backward"):
        opt.drop_micro_step()
    opt2 = Accumulate(torch.optim.SGD(mlp(59).parameters(), lr=0.1), every=1, buffer=True)
    m2 = [g["params"] for g in opt2.param_groups]
    assert m2
    loss = sum(p.sum() for p in opt2.param_groups[0]["params"])
    loss.backward()  # closes the window (every=1)
    with pytest.raises(RuntimeError, match="the window is complete"):
        opt2.drop_micro_step()


@pytest.mark.parametrize("saved_by", [{"buffer": True}])
def test_a_buffer_false_wrapper_loading_a_routed_window_still_refuses_to_drop_finished_work(
    saved_by: dict[str, Any],
) -> None:
    """A checkpoint of a wrapper that routes every parameter through the buffer, loaded into
    one built with buffer=False: that wrapper's later micro-steps stay in .grad, so a failed
    pass cannot be dropped alone (the load made it claim it could: a finished micro-step was
    dropped with it and the update was 8.7e-3 off the full batch, without an error)."""
    ref, model = twins(mlp(61))
    src_model = copy.deepcopy(model)
    x, y = data(61, 8)
    source = Accumulate(torch.optim.SGD(src_model.parameters(), lr=0.1), every=4, **saved_by)
    (mse_sum(src_model, x[:2], y[:2]) / 2).backward()
    source.step()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4, buffer=False)
    opt.load_state_dict(copy.deepcopy(source.state_dict()))
    (mse_sum(model, x[2:4], y[2:4]) / 2).backward()  # a finished micro-step, in .grad
    opt.step()
    with pytest.raises(RuntimeError, match="cannot be dropped alone"):
        opt.drop_micro_step()
    for i in (4, 6):
        (mse_sum(model, x[i : i + 2], y[i : i + 2]) / 2).backward()
        opt.step()
    assert opt.did_update
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    assert_same_params(model, ref)


def test_runner_mean_loss_with_a_zero_item_micro_batch_is_finite() -> None:
    from accumopt import MicroBatchRunner

    ref, model = twins(mlp(61))
    x, y = data(61, 6)
    weight = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # rows 2-3: no item carries a loss

    def masked_mean(m: nn.Module, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor) -> Any:
        per_row = ((m(xb) - yb) ** 2).sum(1) * wb
        return per_row.sum() / wb.sum(), wb.sum()

    loss_ref, _n_ref = masked_mean(ref, x, y, weight)
    loss_ref.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    runner = MicroBatchRunner(
        acc, lambda b: masked_mean(model, *b), micro_batch_size=2, loss_reduction="mean"
    )
    mean = runner((x, y, weight))
    assert torch.isfinite(mean)
    torch.testing.assert_close(mean, loss_ref.detach())
    assert_same_params(model, ref)

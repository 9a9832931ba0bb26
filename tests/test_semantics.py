"""One test per semantic point of the core wrapper, each against a float64 full-batch reference.

Test names start with the number of the point they cover: 1 counting/averaging, 2 exact
weighting, 3 windows in items, 4 the short last window, 5 reduction="sum", 6 LR schedulers,
7 clipping, 9 checkpoints, 10 the awkward cases. AMP (8) is in test_amp.py, bad input (11) in
test_errors.py.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    OPTIMIZERS,
    assert_same_params,
    data,
    full_batch_step,
    mlp,
    mse_sum,
    twins,
)
from torch import nn

import accumopt
from accumopt import Accumulate


def run_window(
    acc: Accumulate,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    sizes: list[int],
    weighted: bool = True,
) -> None:
    for xb, yb in zip(x.split(sizes), y.split(sizes)):
        if weighted:
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
        else:
            (mse_sum(model, xb, yb) / len(xb)).backward()
        acc.step()
        acc.zero_grad()


# ---------------------------------------------------------------- 1. counting and averaging


def test_1_counting_grad_holds_window_mean_before_step() -> None:
    ref, model = twins(mlp(0))
    x, y = data(0, 8)
    (mse_sum(ref, x, y) / 8).backward()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    params_before = [p.detach().clone() for p in model.parameters()]
    for i, (xb, yb) in enumerate(zip(x.split(2), y.split(2))):
        assert not acc.will_update
        (mse_sum(model, xb, yb) / 2).backward()
        assert acc.micro_step == i + 1
        assert acc.will_update == (i == 3)
        if acc.will_update:  # right after the window's last backward, before step()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        acc.step()
        assert acc.did_update == (i == 3)
        if i < 3:  # nothing moves inside the window, bit for bit
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
        acc.zero_grad()
    assert acc.updates == 1 and acc.micro_step == 0


def test_1_counting_hooks_see_the_wrapper_as_it_is() -> None:
    """A window hook runs on the closed window (will_update, state_dict work there); a
    micro-step hook that calls into the wrapper is told a hook is running, not that a call
    failed, and the run goes on exact."""
    ref, model = twins(mlp(5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    seen: list[object] = []

    def on_micro_step(opt: Accumulate, items: object, synced: bool) -> None:
        with pytest.raises(RuntimeError, match="a micro-step hook is running") as err:
            opt.state_dict()
        assert "discard" not in str(err.value)
        seen.append(opt.micro_step)

    def on_window(opt: Accumulate) -> None:
        assert opt.will_update and opt.phase is accumopt.Phase.CLOSED
        seen.append(accumopt.checkpoint_position(opt.state_dict()))  # a closed window's save

    acc.register_micro_step_hook(on_micro_step)
    acc.register_window_hook(on_window)
    x, y = data(5, 8)
    full_batch_step(ref, ref_opt, x, y)
    run_window(acc, model, x, y, [3, 5])
    assert seen == [1, 2, (0, 2)] and acc.updates == 1
    assert_same_params(model, ref)


def test_1_counting_hand_computed_sgd_update() -> None:
    """Gradients 1, 2, 3, 4 averaged over every=4 with SGD(lr=1) move w by exactly -2.5."""
    w = nn.Parameter(torch.zeros(()))
    acc = Accumulate(torch.optim.SGD([w], lr=1.0), every=4)
    for g in (1.0, 2.0, 3.0, 4.0):
        (w * g).backward()
        acc.step()
        acc.zero_grad()
    assert w.item() == -2.5


def test_1_counting_step_without_backward_raises() -> None:
    model = mlp(0)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    with pytest.raises(RuntimeError, match="no backward pass since the last step"):
        acc.step()
    x, y = data(0, 2)
    mse_sum(model, x, y).backward()
    acc.step()
    with pytest.raises(RuntimeError, match="no backward pass since the last step"):
        acc.step()
    assert acc.micro_step == 1  # the rejected call counted nothing


def test_1_counting_ignores_autograd_grad() -> None:
    model = mlp(0)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    x, y = data(0, 3)
    torch.autograd.grad(mse_sum(model, x, y), list(model.parameters()))
    assert acc.micro_step == 0


def test_1_counting_clip_at_boundary_pattern_equals_full_batch() -> None:
    """The common `if boundary: clip_grad_norm_` pattern sees the window's mean gradient."""
    ref, model = twins(mlp(1))
    x, y = data(1, 12)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (mse_sum(ref, x, y) / 12).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=3)
    for xb, yb in zip(x.split(4), y.split(4)):
        (mse_sum(model, xb, yb) / 4).backward()
        if acc.will_update:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        acc.step()
        acc.zero_grad()
    assert_same_params(model, ref)


# ---------------------------------------------------------------- 2. exact weighting


def test_2_exact_weighting_ragged_last_batch() -> None:
    ref, model = twins(mlp(2))
    x, y = data(2, 10)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    full_batch_step(ref, ref_opt, x, y)
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every=3)
    run_window(acc, model, x, y, [4, 4, 2])
    assert_same_params(model, ref)


def test_2_exact_weighting_uniform_averaging_would_be_wrong() -> None:
    """Control: the same ragged window without items is measurably off (the bug class)."""
    ref, model = twins(mlp(2))
    x, y = data(2, 10)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    run_window(acc, model, x, y, [4, 4, 2], weighted=False)
    with pytest.raises(AssertionError):
        assert_same_params(model, ref)


def test_2_exact_weighting_item_count_as_tensor() -> None:
    ref, model = twins(mlp(3))
    x, y = data(3, 7)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    for xb, yb in zip(x.split([5, 2]), y.split([5, 2])):
        acc.backward(mse_sum(model, xb, yb), items=torch.tensor(len(xb)))
        acc.step()
    assert_same_params(model, ref)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum_nesterov_wd"])
def test_2_exact_weighting_zero_item_window_changes_nothing(opt_name: str) -> None:
    model = mlp(4)
    before = copy.deepcopy(model)
    acc = Accumulate(OPTIMIZERS[opt_name](list(model.parameters())), every=2)
    x, y = data(4, 4)
    for xb, yb in zip(x.split(2), y.split(2)):
        acc.backward(mse_sum(model, xb, yb) * 0.0, items=0)  # e.g. all tokens are padding
        acc.step()
    assert not acc.did_update and acc.updates == 0 and acc.micro_step == 0
    assert_same_params(model, before, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_2_exact_weighting_micro_batch_that_reaches_no_parameter_counts_its_items() -> None:
    model = mlp(5)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    x, y = data(5, 3)
    acc.backward(mse_sum(model, x, y), items=3)
    acc.step()
    acc.backward(torch.zeros((), requires_grad=True), items=0)  # an empty micro-batch
    assert acc.will_update and acc.items == 3
    acc.step()
    assert acc.did_update


# ---------------------------------------------------------------- 3. window in items


def test_3_window_in_items_keeps_effective_batch_when_micro_size_changes() -> None:
    ref, model = twins(mlp(6))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    acc = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.01), every_items=12)
    for w, sizes in enumerate([[4, 4, 4], [6, 6], [3, 2, 5, 1, 1], [12]]):
        x, y = data(60 + w, 12)
        full_batch_step(ref, ref_opt, x, y)
        run_window(acc, model, x, y, sizes)
        assert acc.updates == w + 1
        assert_same_params(model, ref)


def test_3_window_in_items_closes_at_first_micro_step_reaching_target() -> None:
    """A micro-batch that overshoots the target closes the window with all its items."""
    ref, model = twins(mlp(7))
    x, y = data(7, 14)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=10)
    run_window(acc, model, x, y, [6, 8])
    assert acc.updates == 1
    assert_same_params(model, ref)


# ---------------------------------------------------------------- 4. the last short window


@pytest.mark.parametrize("weighted", [True, False])
def test_4_flush_partial_window_is_exact(weighted: bool) -> None:
    """2 of every=4 micro-batches at epoch end: the update is their mean, not half of it."""
    ref, model = twins(mlp(8))
    x, y = data(8, 4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    full_batch_step(ref, ref_opt, x, y)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), every=4)
    run_window(acc, model, x, y, [2, 2], weighted=weighted)
    assert acc.micro_step == 2 and acc.updates == 0
    assert acc.flush() is True and acc.did_update
    assert_same_params(model, ref)
    assert all(p.grad is None for p in model.parameters())  # nothing leaks into next epoch
    assert acc.micro_step == 0
    assert acc.flush() is False  # nothing pending: no-op


def test_4_flush_then_next_epoch_is_a_fresh_window() -> None:
    ref, model = twins(mlp(9))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every=3)
    for epoch in range(2):
        x, y = data(90 + epoch, 10)  # 10 = 3 + 3 + 3 + 1 -> windows [3,3,3] and a tail [1]
        for start, stop in [(0, 3), (3, 6), (6, 9), (9, 10)]:
            full_batch_step(ref, ref_opt, x[start:stop], y[start:stop])
        run_window(acc, model, x, y, [1] * 10)
        acc.flush()
    assert acc.updates == 8
    assert_same_params(model, ref)


def test_4_discard_drops_the_partial_window() -> None:
    model = mlp(10)
    before = copy.deepcopy(model)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    x, y = data(10, 2)
    run_window(acc, model, x, y, [1, 1])
    acc.discard()
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    assert_same_params(model, before, rtol=0, atol=0)


# ---------------------------------------------------------------- 5. reduction="sum"


def test_5_reduction_sum_gives_summed_gradients() -> None:
    ref, model = twins(mlp(11))
    x, y = data(11, 6)
    sizes = [1, 2, 3]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    sum(mse_sum(ref, xb, yb) / len(xb) for xb, yb in zip(x.split(sizes), y.split(sizes))).backward()
    ref_opt.step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.01), every=3, reduction="sum")
    run_window(acc, model, x, y, sizes, weighted=False)
    assert_same_params(model, ref)


# ---------------------------------------------------------------- 6. LR schedulers


def test_6_scheduler_follows_real_steps_and_matches_effective_batch_run() -> None:
    ref, model = twins(mlp(12))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.5, total_steps=5)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), every=4)
    sched = torch.optim.lr_scheduler.OneCycleLR(acc, max_lr=0.5, total_steps=5)
    ref_lrs, lrs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for w in range(5):
            x, y = data(120 + w, 8)
            full_batch_step(ref, ref_opt, x, y)
            ref_sched.step()
            ref_lrs.append(ref_opt.param_groups[0]["lr"])
            for xb, yb in zip(x.split(2), y.split(2)):
                (mse_sum(model, xb, yb) / 2).backward()
                acc.step()
                if acc.did_update:
                    sched.step()
                    lrs.append(acc.param_groups[0]["lr"])
                acc.zero_grad()
    assert lrs == ref_lrs
    assert_same_params(model, ref)


def test_6_scheduler_on_inner_optimizer_also_works() -> None:
    model = mlp(13)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    acc = Accumulate(inner, every=2)
    x, y = data(13, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for xb, yb in zip(x.split(1), y.split(1)):
            mse_sum(model, xb, yb).backward()
            acc.step()
            if acc.did_update:
                sched.step()
            acc.zero_grad()
    assert inner.param_groups[0]["lr"] == 0.5**4


# ---------------------------------------------------------------- 7. clipping


def test_7_max_grad_norm_clips_the_window_gradient_once() -> None:
    ref, model = twins(mlp(14))
    x, y = data(14, 9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (mse_sum(ref, x, y) / 9).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert norm > 0.1  # the clip is active
    ref_opt.step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=3, max_grad_norm=0.1)
    run_window(acc, model, x, y, [2, 3, 4])
    assert_same_params(model, ref)


# ---------------------------------------------------------------- 9. checkpoints


def make_run(seed: int) -> tuple[nn.Module, Accumulate]:
    model = mlp(seed)
    return model, Accumulate(torch.optim.AdamW(model.parameters(), lr=0.01), every=4)


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 5, 6])
def test_9_checkpoint_mid_window_resumes_bitwise(stop_after: int) -> None:
    x, y = data(15, 16)
    sizes = [3, 1, 2, 2, 4, 1, 2, 1]
    model, acc = make_run(15)
    run_window(acc, model, x, y, sizes)  # two windows, uninterrupted

    model2, acc2 = make_run(15)
    cut = sum(sizes[:stop_after])
    run_window(acc2, model2, x[:cut], y[:cut], sizes[:stop_after])
    buffer = io.BytesIO()
    torch.save({"model": model2.state_dict(), "opt": acc2.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    model3, acc3 = make_run(99)  # a fresh process: other initial weights, no grads
    model3.load_state_dict(saved["model"])
    acc3.load_state_dict(saved["opt"])
    assert acc3.micro_step == acc2.micro_step and acc3.updates == acc2.updates
    run_window(acc3, model3, x[cut:], y[cut:], sizes[stop_after:])
    for p, q in zip(model.parameters(), model3.parameters()):
        assert torch.equal(p, q)


def test_9_bare_inner_state_dicts_load_both_ways() -> None:
    model, acc = make_run(16)
    x, y = data(16, 4)
    run_window(acc, model, x, y, [1, 1, 1, 1])
    bare = torch.optim.AdamW(model.parameters(), lr=0.01)
    bare.load_state_dict(acc.state_dict())  # the entry rides along as a group value
    assert bare.state_dict()["state"][0]["step"] == 1
    _, acc2 = make_run(16)
    acc2.load_state_dict(bare.state_dict())  # nothing changed since: the entry still holds
    assert acc2.micro_step == 0 and acc2.updates == 1
    bare.zero_grad()
    model(x).sum().backward()
    bare.step()  # the bare optimizer trains on: the entry it carries is stale
    _, acc3 = make_run(16)
    acc3.load_state_dict(bare.state_dict())  # a fresh window, as from a bare state dict
    assert acc3.micro_step == 0 and acc3.updates == 0
    assert acc3.optimizer.state_dict()["state"][0]["step"] == 2
    _, acc4 = make_run(16)
    acc4.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())  # no entry at all
    assert acc4.micro_step == 0 and acc4.updates == 0


def test_9_deepcopy_and_pickle_after_scheduler_attached() -> None:
    model, acc = make_run(17)
    torch.optim.lr_scheduler.StepLR(acc, step_size=1)
    x, y = data(17, 2)
    run_window(acc, model, x, y, [1, 1])
    for clone in (copy.deepcopy(acc), pickle.loads(pickle.dumps(acc))):
        assert clone.micro_step == 2 and clone.every == 4
        assert clone.param_groups is clone.optimizer.param_groups
        params = [p for g in clone.param_groups for p in g["params"]]
        assert all(p.grad is not None for p in params)
        assert "step" not in clone.__dict__  # the scheduler's patch is not carried over
    copied = copy.deepcopy({"model": model, "acc": acc})
    m2, a2 = copied["model"], copied["acc"]
    before = [p.detach().clone() for p in model.parameters()]
    run_window(a2, m2, x, y, [1, 1])  # steps the copy only
    assert a2.updates == 1 and acc.micro_step == 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ---------------------------------------------------------------- 10. the awkward cases


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("zero_first", [True, False])
def test_10_zero_grad_every_micro_step_never_wipes_the_window(
    set_to_none: bool, zero_first: bool
) -> None:
    ref, model = twins(mlp(18))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    for w in range(2):
        x, y = data(180 + w, 6)
        full_batch_step(ref, ref_opt, x, y)
        for xb, yb in zip(x.split(2), y.split(2)):
            if zero_first:
                acc.zero_grad(set_to_none=set_to_none)
            (mse_sum(model, xb, yb) / 2).backward()
            acc.step()
            if not zero_first:
                acc.zero_grad(set_to_none=set_to_none)
    assert_same_params(model, ref)


class TwoHeads(nn.Module):
    """A model whose micro-batches use different parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(19)
        self.body = nn.Linear(4, 5)
        self.heads = nn.ModuleList([nn.Linear(5, 3), nn.Linear(5, 3), nn.Linear(5, 3)])

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](torch.tanh(self.body(x)))


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum_nesterov_wd"])
def test_10_parameters_unused_in_some_micro_batches(opt_name: str) -> None:
    ref, model = twins(TwoHeads())
    x, y = data(19, 6)
    heads = [0, 1, 0]  # head 2 unused all window: keeps grad None and does not move
    ref_opt = OPTIMIZERS[opt_name](list(ref.parameters()))
    sum(
        F.mse_loss(ref(xb, h), yb, reduction="sum")
        for xb, yb, h in zip(x.split(2), y.split(2), heads)
    ).div(6).backward()
    ref_opt.step()
    acc = Accumulate(OPTIMIZERS[opt_name](list(model.parameters())), every=3)
    for xb, yb, h in zip(x.split(2), y.split(2), heads):
        acc.backward(F.mse_loss(model(xb, h), yb, reduction="sum"), items=2)
        if acc.will_update:
            assert all(p.grad is None for p in model.heads[2].parameters())
        acc.step()
    assert_same_params(model, ref)
    assert torch.equal(model.heads[2].weight, ref.heads[2].weight)


def test_10_frozen_parameters_and_param_groups_with_own_hyperparameters() -> None:
    ref, model = twins(mlp(20))
    for m in (ref, model):
        m[0].bias.requires_grad_(False)

    def groups(m: nn.Module) -> list[dict[str, object]]:
        return [
            {"params": [m[0].weight, m[0].bias], "lr": 0.01, "weight_decay": 0.5},
            {"params": list(m[2].parameters()), "lr": 0.1},
        ]

    ref_opt = torch.optim.AdamW(groups(ref))
    acc = Accumulate(torch.optim.AdamW(groups(model)), every=2)
    x, y = data(20, 8)
    full_batch_step(ref, ref_opt, x, y)
    run_window(acc, model, x, y, [5, 3])
    assert_same_params(model, ref)
    assert model[0].bias.grad is None


def test_10_add_param_group_after_wrapping_is_counted() -> None:
    ref, model = twins(mlp(21))
    ref_opt = torch.optim.SGD(ref[0].parameters(), lr=0.1)
    ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 0.2})
    acc = Accumulate(torch.optim.SGD(model[0].parameters(), lr=0.1), every=2)
    acc.add_param_group({"params": list(model[2].parameters()), "lr": 0.2})
    assert len(acc.optimizer.param_groups) == 2
    x, y = data(21, 4)
    full_batch_step(ref, ref_opt, x, y)
    run_window(acc, model, x, y, [2, 2])
    assert_same_params(model, ref)


@pytest.mark.parametrize("how", ["wrapper", "inner", "append"])
def test_10_a_group_added_between_windows_and_inside_one_is_divided_with_the_window(
    how: str,
) -> None:
    # the wrapper reuses one list of its parameters within a window: a group added after an
    # update, or inside the open window (through the wrapper, the inner optimizer, or by
    # appending to a group's list), must still be divided at the next boundary
    def add(acc: Accumulate, params: list[nn.Parameter]) -> None:
        if how == "wrapper":
            acc.add_param_group({"params": params, "lr": 0.2})
        elif how == "inner":
            acc.optimizer.add_param_group({"params": params, "lr": 0.2})
        else:
            acc.param_groups[0]["params"].extend(params)

    for inside in (False, True):
        ref, model = twins(mlp(23))
        ref_opt = torch.optim.SGD(ref[0].parameters(), lr=0.1)
        acc = Accumulate(torch.optim.SGD(model[0].parameters(), lr=0.1), every=2, model=model)
        x, y = data(23, 8)
        full_batch_step(ref, ref_opt, x[:4], y[:4])
        run_window(acc, model, x[:4], y[:4], [2, 2])
        lr = 0.1 if how == "append" else 0.2
        ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": lr})
        full_batch_step(ref, ref_opt, x[4:], y[4:])
        for p in model[2].parameters():  # what the first window left there: no group's
            p.grad = None
        if not inside:
            add(acc, list(model[2].parameters()))
        for i, (xb, yb) in enumerate(zip(x[4:].split(2), y[4:].split(2))):
            (mse_sum(model, xb, yb) / len(xb)).backward()
            if inside and i == 0:
                add(acc, list(model[2].parameters()))
            acc.step()
            acc.zero_grad()
        assert acc.updates == 2
        assert_same_params(model, ref)


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(22)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(1))


@pytest.mark.parametrize("kind", ["sgd", "sparse_adam"])
def test_10_sparse_gradients(kind: str) -> None:
    ref, model = twins(Bag())

    def make(m: Bag) -> list[torch.optim.Optimizer]:
        if kind == "sgd":
            return [torch.optim.SGD(m.parameters(), lr=0.5)]
        return [
            torch.optim.SparseAdam([m.emb.weight], lr=0.1),
            torch.optim.Adam(m.out.parameters()),
        ]

    g = torch.Generator().manual_seed(22)
    ids, target = torch.randint(0, 10, (6, 3), generator=g), torch.randn(6, 1, generator=g)
    ref_opts = make(ref)
    (F.mse_loss(ref(ids), target, reduction="sum") / 6).backward()
    for o in ref_opts:
        o.step()
    accs = [Accumulate(o, every=2) for o in make(model)]
    for sl in (slice(0, 3), slice(3, 6)):  # equal micro-batches: plain mean losses are exact
        (F.mse_loss(model(ids[sl]), target[sl], reduction="sum") / 3).backward()
        for acc in accs:  # each wrapper counts the backward pass through its own parameters
            acc.step()
    assert_same_params(model, ref)


@pytest.mark.parametrize("rows_later", [[3], [1, 3]])
def test_10_a_sparse_gradient_set_to_none_inside_the_window_is_refused(
    rows_later: list[int],
) -> None:
    # sparse accumulation may replace the tensor (create_graph=True below), so a replaced
    # sparse .grad is taken for accumulation only if it kept every row the window had reached
    model = Bag()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=2)
    model(torch.tensor([[1, 2]])).sum().backward()
    acc.step()
    model.emb.weight.grad = None  # the first micro-step's rows 1 and 2 are lost
    with pytest.raises(RuntimeError, match="replaced or cleared"):  # checked at the close
        model(torch.tensor([rows_later])).sum().backward()


def test_10_sparse_sums_replaced_by_create_graph_accumulation_are_not_refused() -> None:
    # a sparse sum without a history: create_graph=True makes accumulation replace it
    torch.manual_seed(24)
    ref, model = twins(nn.Embedding(10, 4, sparse=True))
    ids = torch.tensor([[1, 2], [3, 1]])
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (ref(ids).sum() / 2).backward()  # linear: the gradients have no history
    ref_opt.step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: create_graph=True and .grad make a cycle
        for row in ids:
            model(row).sum().backward(create_graph=True)  # one row: its mean
            acc.step()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_2_weighting_a_negative_tensor_count_is_refused_at_the_close() -> None:
    """Counts given as tensors are read once, at the close: a negative one is refused there
    even where the window's total is a valid count, before any update."""
    model = mlp(6)
    before = copy.deepcopy(model)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    x, y = data(6, 8)
    acc.backward(mse_sum(model, x[:4], y[:4]), items=torch.tensor(32))
    acc.step()
    with pytest.raises(ValueError, match=r"a micro-step's items=-16"):
        acc.backward(mse_sum(model, x[4:], y[4:]), items=torch.tensor(-16))
    assert acc.updates == 0
    assert_same_params(model, before, rtol=0, atol=0)

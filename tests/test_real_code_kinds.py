"""The kinds of fault real training code found in 0.1, each exact or loud on the 0.2 core, each
against a float64 full-batch reference (the integrations' kinds are in their own tests)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import pytest
import torch
from helpers import assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from torch import nn
from torch.utils.checkpoint import checkpoint

from accumopt import Accumulate, Phase
from accumopt.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import this module


class Checkpointed(nn.Module):
    """Its first layer runs under reentrant activation checkpointing: the backward pass of
    that part is a nested pass, run inside the outer one."""

    def __init__(self, seed: int, last: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.second = nn.Linear(4, 6), nn.Linear(6, 3)
        self.last = last  # the checkpointed part comes last in the backward pass too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.last:  # nothing watched after the checkpointed part: the nested pass first
            return checkpoint(self.second, torch.tanh(self.first(x)), use_reentrant=True)
        # reentrant checkpointing needs an input that requires grad to reach the parameters
        x = x.detach().requires_grad_()
        return self.second(checkpoint(self.first, x, use_reentrant=True).tanh())


@pytest.mark.parametrize("last", [False, True], ids=["nested-first", "nested-only"])
@pytest.mark.parametrize("given", [False, True], ids=["parameters", "model="])
def test_a_nested_reentrant_backward_pass_is_part_of_its_outer_pass(
    last: bool, given: bool
) -> None:
    """0.1 counted a nested pass that reached a watched parameter first as a micro-step of its
    own: twice the updates at half the learning rate, silently."""
    ref, model = Checkpointed(30, last), Checkpointed(30, last)
    acc = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1), every=3, model=model if given else None
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data(30, 12)
    for w in range(2):
        xw, yw = x[6 * w : 6 * w + 6], y[6 * w : 6 * w + 6]
        for xb, yb in zip(xw.split(2), yw.split(2)):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            acc.zero_grad()
        full_batch_step(ref, ref_opt, xw, yw)
    assert acc.updates == 2
    assert_same_params(model, ref)


@pytest.mark.parametrize("through", ["next_items", "backward"])
def test_two_wrappers_over_one_model_share_each_pass_s_items(through: str) -> None:
    """Muon-style splits (one optimizer for the matrices, one for the rest): the items of a
    pass belong to the pass, so the wrapper not told divides by them too (0.1 divided it by
    its micro-steps, silently)."""
    ref, model = twins(mlp(31))
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    a = Accumulate(torch.optim.SGD(matrices, lr=0.1), every=3)
    b = Accumulate(torch.optim.SGD(rest, lr=0.1), every=3)
    x, y = data(31, 9)
    for xb, yb in zip(x.split([2, 4, 3]), y.split([2, 4, 3])):
        if through == "next_items":
            a.next_items(len(xb))
            mse_sum(model, xb, yb).backward()
        else:
            a.backward(mse_sum(model, xb, yb), items=len(xb))
        for opt in (a, b):
            opt.step()
            opt.zero_grad()
    assert a.updates == b.updates == 1 and a.items == b.items == 0.0
    assert a.last_window.items == b.last_window.items == 9.0  # type: ignore[union-attr]
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    assert_same_params(model, ref)


def test_a_boundary_gated_grad_scaler_loop_without_scaler_is_exact() -> None:
    """PyTorch's AMP recipe: scaler.step, unscale_ and clipping at the boundary only, one loss
    scale all window long; no scaler= needed (0.1 refused it after unscaling and clipping
    had run, naming a missing loss scale)."""
    ref, model = twins(mlp(32))
    x, y = data(32, 12)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    (mse_sum(ref, x, y) / 12).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    for xb, yb in zip(x.split(3), y.split(3)):
        acc.backward(scaler.scale(mse_sum(model, xb, yb)), items=3)
        if acc.will_update:
            scaler.unscale_(acc)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(acc)
            scaler.update()
        acc.zero_grad()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_scaler_step_every_micro_step_without_scaler_is_refused_before_anything_changes() -> None:
    model = mlp(33)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    x, y = data(33, 3)
    acc.backward(scaler.scale(mse_sum(model, x, y)), items=3)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="built without scaler="):
        scaler.step(acc)
    assert acc.phase is Phase.OPEN and acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_around_the_inner_step_never_leaves_the_update_count_short(
    when: str,
) -> None:
    """A KeyboardInterrupt in the inner optimizer's own pre-step hook (before the update) or
    post-step hook (after it): ``updates``/``did_update`` say exactly whether it happened (0.1
    could be one short, and a did_update-driven scheduler missed a step)."""
    model = mlp(34)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulate(inner, every=2)
    armed = [True]

    def interrupt(*_: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    (inner.register_step_pre_hook if when == "before" else inner.register_step_post_hook)(interrupt)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(34, 4)
    for xb, yb in zip(x.split(2), y.split(2)):
        acc.backward(mse_sum(model, xb, yb), items=2)
        with contextlib.suppress(KeyboardInterrupt):
            acc.step()
    moved = not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert moved == (when == "after") and acc.updates == int(moved) and acc.did_update == moved
    assert acc.phase is (Phase.OPEN if moved else Phase.BROKEN)


def _static_graph_rank(rank: int) -> list[list[float]]:
    torch.set_default_dtype(torch.float64)
    model = mlp(35)
    ddp = nn.parallel.DistributedDataParallel(model, static_graph=True)
    acc = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=2, model=ddp)
    x, y = data(35, 16)
    for w in range(2):
        for m in range(2):
            a = 8 * w + 4 * m + 2 * rank
            acc.backward(mse_sum(ddp, x[a : a + 2], y[a : a + 2]), items=2)
            acc.step()
            acc.zero_grad()
    assert acc.updates == 2
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_ddp_static_graph_trains_exactly() -> None:
    """DDP(static_graph=True) needs its first pass synced to record the graph (0.1 ran it
    without a sync: torch's internal assert on the first backward pass)."""
    ranks = run_ranks(_static_graph_rank, timeout_s=60)
    assert ranks[0] == ranks[1]
    ref = mlp(35)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data(35, 16)
    for w in range(2):
        full_batch_step(ref, ref_opt, x[8 * w : 8 * w + 8], y[8 * w : 8 * w + 8])
    for got, q in zip(ranks[0], ref.parameters()):
        torch.testing.assert_close(torch.tensor(got), q.detach().flatten(), rtol=1e-10, atol=1e-12)

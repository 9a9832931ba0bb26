"""DistributedDataParallel + Accumulate on 2 CPU processes (gloo), spawned by the tests.

Each scenario runs in two fresh processes that train a float64 DDP model; the parent compares
both ranks' parameters with single-process full-batch training on the union of all ranks'
micro-batches, and counts DDP's all-reduces with a communication hook.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from accumopt.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))

WORLD = 2
WINDOWS = 3
EVERY = 3


def model_and_data(seed: int = 7) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    # explicit dtype: the parent test process runs with float64 as default, the children not
    f64 = torch.float64
    model = nn.Sequential(nn.Linear(4, 6, dtype=f64), nn.Tanh(), nn.Linear(6, 3, dtype=f64))
    g = torch.Generator().manual_seed(seed)
    n = 200
    return (
        model,
        torch.randn(n, 4, generator=g, dtype=torch.float64),
        torch.randn(n, 3, generator=g, dtype=torch.float64),
    )


def make_opt(params: Any) -> torch.optim.Optimizer:
    # SGD with momentum: Adam's g / (|g| + eps) would magnify 1e-16 summation-order
    # differences in near-zero gradient entries past the float64 tolerance
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def layout(scenario: str) -> list[list[list[tuple[int, int]]]]:
    """[window][rank] -> list of (start, stop) rows of that rank's micro-batches."""
    out, row = [], 0
    for w in range(WINDOWS):
        per_rank = []
        for r in range(WORLD):
            if scenario == "equal":
                sizes = [4] * EVERY
            else:  # uneven across micro-steps, ranks and windows
                sizes = [1 + (w + 2 * r + 3 * j) % 5 for j in range(EVERY)]
            slices = []
            for size in sizes:
                slices.append((row, row + size))
                row += size
            per_rank.append(slices)
        out.append(per_rank)
    return out


def reference(scenario: str, weighted: bool) -> list[torch.Tensor]:
    """Single-process training: one step per window on the mean over its rows (weighted) or
    over its micro-batch means (unweighted: every micro-batch counts alike)."""
    model, x, y = model_and_data()
    opt = make_opt(model.parameters())
    for window in layout(scenario):
        slices = [s for rank in window for s in rank]
        opt.zero_grad()
        if weighted:
            rows = sum(b - a for a, b in slices)
            loss = sum(((model(x[a:b]) - y[a:b]) ** 2).sum() for a, b in slices) / rows
        else:
            means = [((model(x[a:b]) - y[a:b]) ** 2).sum() / (b - a) for a, b in slices]
            loss = sum(means) / len(means)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def plain(model: nn.Module) -> list[list[float]]:
    """Parameters as Python lists: tensors sent back from a rank would be shared-memory handles
    that die with the child process."""
    return [p.detach().flatten().tolist() for p in model.parameters()]


def worker(rank: int, scenario: str, mode: str) -> tuple[Any, ...]:
    """One rank: train a DDP model in ``mode``; its parameters, comm-hook counts and accumopt's
    own all-reduce count."""
    from accumopt import Accumulate

    base, x, y = model_and_data()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    calls = {"n": 0, "bytes": 0}

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the
        # annotations it finds, and "from __future__ import annotations" makes them strings
        calls["n"] += 1
        calls["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return (
            dist.all_reduce(bucket.buffer(), async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0] / WORLD)
        )

    ddp.register_comm_hook(None, counting_hook)
    inner = make_opt(ddp.parameters())
    weighted = mode != "plain"
    if mode.startswith("auto_oom"):  # OOM on rank 0 only: both ranks back off together
        return run_auto(rank, ddp, inner, x, y, scenario, later=mode == "auto_oom_later")
    if mode == "hand":  # the usual loop without accumulation-aware syncing
        for window in layout(scenario):
            for a, b in window[rank]:
                (((ddp(x[a:b]) - y[a:b]) ** 2).sum() / (b - a) / EVERY).backward()
            inner.step()
            inner.zero_grad()
        return plain(ddp), dict(calls), 0
    kwargs: dict[str, Any] = {"every": EVERY}
    scaler = None
    if mode == "items":
        kwargs = {"every_items": sum(b - a for r in layout(scenario)[0] for a, b in r)}
    if mode == "amp":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        kwargs["scaler"] = scaler
    opt = Accumulate(inner, model=ddp, **kwargs)
    for window in layout(scenario):
        for a, b in window[rank]:
            loss = ((ddp(x[a:b]) - y[a:b]) ** 2).sum()
            if scaler is not None:
                loss = scaler.scale(loss)
            if weighted:
                opt.backward(loss, items=b - a)
            else:
                (loss / (b - a)).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    assert opt.updates == WINDOWS, opt.updates
    return plain(ddp), dict(calls), opt._sync.all_reduces  # type: ignore[union-attr]


def run_auto(
    rank: int,
    ddp: nn.Module,
    inner: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    scenario: str,
    later: bool,
) -> tuple[Any, ...]:
    """The "auto" runner with OOM on rank 0 only; ``later``: the runner is built before the
    wrapper is given the DDP model (``set_model``, as frameworks do)."""
    from accumopt import Accumulate, MicroBatchRunner
    from accumopt.testing import simulate_oom

    windows = layout(scenario)
    rows = sum(b - a for r in windows[0] for a, b in r)
    opt = Accumulate(inner, every_items=rows, model=None if later else ddp)
    runner = MicroBatchRunner(opt, lambda b: ((ddp(b[0]) - b[1]) ** 2).sum(), loss_reduction="sum")
    if later:
        opt.set_model(ddp)
    limit = 5 if rank == 0 else 10**6
    with simulate_oom(ddp.module, limit, where="backward", at=ddp.module[0]):
        for window in windows:
            idx = torch.cat([torch.arange(a, b) for a, b in window[rank]])
            runner((x[idx], y[idx]))
    assert opt.updates == WINDOWS and runner.ooms > 0, (opt.updates, runner.ooms)
    return plain(ddp), {"ooms": runner.ooms, "size": runner.micro_batch_size}, 0


def run(scenario: str, mode: str) -> list[tuple[Any, ...]]:
    return run_ranks(worker, scenario, mode, world_size=WORLD)


def assert_matches(results: list, expected: list[torch.Tensor]) -> None:
    for params, _, _ in results:
        for p, q in zip(params, expected):
            torch.testing.assert_close(
                torch.tensor(p, dtype=torch.float64), q.flatten(), rtol=1e-10, atol=1e-12
            )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "mode"),
    [("equal", "plain"), ("uneven", "weighted"), ("uneven", "items"), ("uneven", "amp")],
)
def test_ddp_accumulate_equals_single_process_full_batch(scenario: str, mode: str) -> None:
    results = run(scenario, mode)
    assert_matches(results, reference(scenario, weighted=mode != "plain"))
    calls = results[0][1]["n"]
    if mode in ("plain", "weighted"):  # DDP syncs the closing micro-step itself, once
        # one small all-reduce of the item count per update, none per micro-step
        assert calls == WINDOWS and results[0][2] == (WINDOWS if mode == "weighted" else 0)
    else:  # items / AMP: accumopt sums the window once (plus the small item-count sums)
        assert calls == 0


@pytest.mark.slow
def test_one_all_reduce_per_real_step_vs_one_per_micro_step() -> None:
    hand = run("equal", "hand")
    ours = run("equal", "plain")
    assert_matches(ours, reference("equal", weighted=False))
    assert_matches(hand, reference("equal", weighted=False))
    assert hand[0][1]["n"] == WINDOWS * EVERY
    assert ours[0][1]["n"] == WINDOWS
    assert ours[0][1]["bytes"] * EVERY == hand[0][1]["bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto_oom", "auto_oom_later"])
def test_ddp_auto_micro_batch_size_backs_off_together_when_one_rank_runs_out(mode: str) -> None:
    results = run("equal", mode)
    assert_matches(results, reference("equal", weighted=True))
    stats = [r[1] for r in results]
    assert stats[0] == stats[1] and stats[0]["size"] <= 5  # the same search on both ranks


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.used = nn.Linear(3, 1, dtype=torch.float64)
        self.unused = nn.Linear(3, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_worker(rank: int, kwargs: dict[str, Any]) -> list[float]:
    from accumopt import Accumulate

    net = WithUnused()
    before = net.unused.weight.detach().clone()
    ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    opt = Accumulate(torch.optim.AdamW(ddp.parameters(), lr=0.1), model=ddp, **kwargs)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.backward(ddp(torch.randn(4, 3, generator=g, dtype=torch.float64)).pow(2).sum(), items=4)
        if opt.will_update:
            assert net.unused.weight.grad is None
        opt.step()
        opt.zero_grad()
    return [float((net.unused.weight - before).abs().max()), float(opt.updates)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs", [{"every": 2}, {"every_items": 16}, {"every": 2, "buffer": True}]
)
def test_ddp_parameter_unused_on_every_rank_keeps_no_gradient(kwargs: dict[str, Any]) -> None:
    for moved, updates in run_ranks(unused_worker, kwargs, world_size=WORLD):
        assert moved == 0.0 and updates == 2

"""Faults under DDP (2 gloo ranks), each found by an adversarial review and named after it: the
ranks must agree on every decision, and a checkpoint must resume exactly whatever it was
loaded into. One spawn runs every scenario (spawning costs seconds); the parent compares each
rank with single-process full-batch training in float64."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import scenarios_on_ranks
from torch import nn

Rows = list[tuple[int, int]]  # per rank: (start, stop)


def net() -> nn.Module:
    torch.manual_seed(7)
    f64 = torch.float64
    return nn.Sequential(nn.Linear(4, 6, dtype=f64), nn.Tanh(), nn.Linear(6, 3, dtype=f64))


def data(n: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(n, 3, generator=g, dtype=torch.float64)


def full_batch(windows: list[list[Rows]], lr: float = 0.1) -> list[list[float]]:
    """Plain SGD, one step per window on the union of all ranks' rows (the mean over rows)."""
    model, (x, y) = net(), data()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for window in windows:
        rows = [r for micro in window for r in micro]
        opt.zero_grad()
        loss = sum(((model(x[a:b]) - y[a:b]) ** 2).sum() for a, b in rows)
        (loss / sum(b - a for a, b in rows)).backward()  # type: ignore[operator]
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def micro(rank: int, ddp: nn.Module, opt: Any, rows: Rows, scaler: Any = None, bad: bool = False):  # type: ignore[no-untyped-def]
    x, y = data()
    a, b = rows[rank]
    loss = ((ddp(x[a:b]) - y[a:b]) ** 2).sum()
    if bad:
        loss = loss * float("inf")
    if scaler is None:
        opt.backward(loss, items=b - a)
        opt.step()
    else:
        opt.backward(scaler.scale(loss), items=b - a)
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


W1 = [[(0, 2), (5, 8)], [(10, 13), (15, 16)], [(20, 24), (25, 27)]]  # 3 micro-steps, ragged
W2 = [[(30, 31), (35, 39)], [(40, 43), (45, 47)], [(50, 52), (55, 56)]]
W3 = [[(60, 63), (65, 67)], [(70, 71), (75, 79)], [(80, 82), (85, 88)]]


def grad_scaler_inf_on_one_rank(rank: int) -> Any:
    """Per-micro-step scaler.step(opt), an inf on rank 0 only in window 1: both ranks skip
    that window and keep one loss scale."""
    from accumopt import Accumulate

    ddp = nn.parallel.DistributedDataParallel(net())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    opt = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=3, model=ddp, scaler=scaler)
    scales = []
    for w, window in enumerate((W1, W2, W3)):
        for j, rows in enumerate(window):
            micro(rank, ddp, opt, rows, scaler, bad=(w, j, rank) == (0, 1, 0))
        scales.append(scaler.get_scale())
    return [p.detach().flatten().tolist() for p in ddp.parameters()], scales, opt.updates


def load_into_the_live_wrapper_then_flush(rank: int) -> Any:
    """Save after one micro-step, train on to a boundary DDP synchronised, load the checkpoint
    back into the same wrapper and flush the restored window."""
    from accumopt import Accumulate

    ddp = nn.parallel.DistributedDataParallel(net())
    opt = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=3, model=ddp)
    micro(rank, ddp, opt, W1[0])
    buf = io.BytesIO()
    torch.save({"m": ddp.module.state_dict(), "o": opt.state_dict()}, buf)
    for rows in W1[1:]:
        micro(rank, ddp, opt, rows)
    assert opt.did_update
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    ddp.module.load_state_dict(saved["m"])
    opt.load_state_dict(saved["o"])
    assert opt.flush()
    return [p.detach().flatten().tolist() for p in ddp.parameters()]


SCHEDULED = [[W1[0]], W2, [W3[0]], W3[1:]]  # windows of 1, 3, 1 and 2 micro-steps


def schedule_raising_on_one_rank(rank: int) -> Any:
    """A window schedule raises once on rank 0 when asked for a window's size, after window 1
    and after window 2: rank 0 planned DDP's sync of the next pass from the stale size (a
    closing pass after window 1) and waited at the closing-forward agreement rank 1 never
    joined, or (after window 2, whose successor closes at its first pass) ran that pass
    unsynced while rank 1 waited (both found by review). Asked again before the forward, it
    plans as rank 1 does, and both ranks train the schedule's windows."""
    from accumopt import Accumulate

    failed: list[int] = []

    def schedule(updates: int, _seen: float) -> int:
        if rank == 0 and updates in (1, 2) and updates not in failed:
            failed.append(updates)
            raise RuntimeError("transient")
        return [len(w) for w in SCHEDULED][min(updates, 3)]

    ddp = nn.parallel.DistributedDataParallel(net())
    opt = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=schedule, model=ddp)
    for rows in [m for window in SCHEDULED for m in window]:
        try:
            micro(rank, ddp, opt, rows)
        except RuntimeError as err:  # the update was applied; the spent gradient is cleared
            assert str(err) == "transient" and opt.updates in (1, 2)
    return [p.detach().flatten().tolist() for p in ddp.parameters()], opt.updates, failed


def each_rank_loads_its_own_window_or_refuses_rank_0s(rank: int) -> Any:
    """Each rank saves after the window's first micro-step. Resumed into new wrappers, each
    from its own state dict: the window finishes exactly. Every rank given rank 0's (what a
    framework that saves rank 0's optimizer state alone does): rank 1 refuses it; with
    ``agree_on_loads`` (the ranks agree through an all-reduce, as Lightning's callback does
    through its strategy), rank 0 refuses it too. The refusals' messages come back."""
    import torch.distributed as dist

    from accumopt import Accumulate

    def wrapper() -> tuple[nn.Module, Any]:
        ddp = nn.parallel.DistributedDataParallel(net())
        return ddp, Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=3, model=ddp)

    def all_ranks(ok: bool) -> bool:
        flag = torch.tensor(float(ok))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    ddp, opt = wrapper()
    micro(rank, ddp, opt, W1[0])
    own = copy.deepcopy(opt.state_dict())
    shared = [own]
    dist.broadcast_object_list(shared, src=0)  # rank 0's, on every rank
    refused = []
    for agree in (False, True):
        state = shared[0]
        _, late = wrapper()
        if agree:
            late.agree_on_loads(all_ranks)
        try:
            late.load_state_dict(copy.deepcopy(state))
            refused.append(None)
        except ValueError as err:
            refused.append(str(err))
    ddp, resumed = wrapper()
    resumed.load_state_dict(own)
    for rows in W1[1:]:
        micro(rank, ddp, resumed, rows)
    assert resumed.updates == 1
    return [p.detach().flatten().tolist() for p in ddp.parameters()], refused


def discard_on_one_rank(rank: int) -> Any:
    """A window hook raises on rank 0 once window 2 closed there; rank 0 discards the window and
    goes on, as a one-process loop would, while rank 1 applies it. Rank 0's next pass (released
    by discard(): DDP syncs it) paired with rank 1's next sync, and the replicas trained apart
    silently. Rank 0 now agrees before that pass, and rank 1's next agreement (before its
    closing pass) finds it one update ahead: both raise, nothing more is applied."""
    from accumopt import Accumulate

    ddp = nn.parallel.DistributedDataParallel(net())
    opt = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=3, model=ddp)

    def hook(_: Any) -> None:
        if rank == 0 and opt.updates == 1:
            raise ValueError("hook failed")

    opt.register_window_hook(hook)
    x, y = data()
    errors = []
    for a, b in [micro[rank] for window in (W1, W2, W3) for micro in window]:
        try:
            ((ddp(x[a:b]) - y[a:b]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        except (ValueError, RuntimeError) as err:
            errors.append(str(err))
            if "different points" in str(err):
                break
            opt.discard()
    return opt.updates, errors


def static_graph_resumed_mid_window(rank: int) -> Any:
    """A mid-window checkpoint loaded into a fresh ``DDP(static_graph=True)``: its first pass
    must sync, and the wrapper planned it unsynced (the loaded window's plan): DDP's reducer
    failed an internal assert. That pass now syncs (it reduces the loaded window too)."""
    import copy

    from accumopt import Accumulate

    def build() -> Any:
        ddp = nn.parallel.DistributedDataParallel(net(), static_graph=True)
        return ddp, Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=3, model=ddp)

    rows = [m for window in (W1, W2) for m in window]
    ddp, opt = build()
    for r in rows:
        micro(rank, ddp, opt, r)
    straight = [p.detach().flatten().tolist() for p in ddp.parameters()]
    ddp, opt = build()
    for r in rows[:4]:
        micro(rank, ddp, opt, r)
    saved = copy.deepcopy((ddp.module.state_dict(), opt.state_dict()))
    ddp, opt = build()
    ddp.module.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for r in rows[4:]:
        micro(rank, ddp, opt, r)
    return straight, [p.detach().flatten().tolist() for p in ddp.parameters()], opt.updates


SCENARIOS: dict[str, Callable[[int], Any]] = {
    "scaler_inf": grad_scaler_inf_on_one_rank,
    "load_live_flush": load_into_the_live_wrapper_then_flush,
    "own_window": each_rank_loads_its_own_window_or_refuses_rank_0s,
    "schedule_one_rank": schedule_raising_on_one_rank,
    "discard_one_rank": discard_on_one_rank,
    "static_graph_resume": static_graph_resumed_mid_window,
}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return scenarios_on_ranks(__name__, "SCENARIOS")


def assert_close(got: list[list[float]], expected: list[list[float]]) -> None:
    for p, q in zip(got, expected):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_ddp_grad_scaler_inf_on_one_rank_skips_the_window_on_both_and_keeps_one_scale(
    results: list[dict[str, Any]],
) -> None:
    (p0, scales0, updates0), (p1, scales1, updates1) = (r["scaler_inf"] for r in results)
    assert scales0 == scales1 and updates0 == updates1 == 2
    assert p0 == p1
    assert_close(p0, full_batch([W2, W3]))


@pytest.mark.slow
def test_ddp_checkpoint_loaded_into_the_live_wrapper_then_flushed_is_exact(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        assert_close(r["load_live_flush"], full_batch([[W1[0]]]))


@pytest.mark.slow
def test_ddp_each_rank_resumes_its_own_window_and_refuses_another_ranks(
    results: list[dict[str, Any]],
) -> None:
    (p0, refused0), (p1, refused1) = (r["own_window"] for r in results)
    assert_close(p0, full_batch([W1]))
    assert p0 == p1
    assert refused0[0] is None  # rank 0's own window: rank 0 alone cannot tell
    assert "saved by rank 0 of 2, and is loaded on rank 1 of 2" in refused1[0]
    assert "another rank refused the checkpoint's open window" in refused0[1]
    assert "saved by rank 0 of 2, and is loaded on rank 1 of 2" in refused1[1]


@pytest.mark.slow
def test_ddp_a_schedule_raising_on_one_rank_leaves_both_on_its_windows(
    results: list[dict[str, Any]],
) -> None:
    (p0, updates0, failed0), (p1, updates1, failed1) = (r["schedule_one_rank"] for r in results)
    assert failed0 == [1, 2] and failed1 == [] and updates0 == updates1 == 4
    assert p0 == p1
    assert_close(p0, full_batch(SCHEDULED))


@pytest.mark.slow
def test_ddp_a_window_discarded_on_one_rank_is_refused_on_both(
    results: list[dict[str, Any]],
) -> None:
    (updates0, errors0), (updates1, errors1) = (r["discard_one_rank"] for r in results)
    assert (updates0, updates1) == (1, 2)  # rank 0 dropped window 2, rank 1 applied it
    assert errors0[0] == "hook failed" and len(errors0) == 2 and len(errors1) == 1
    for errors in (errors0, errors1):
        assert "at the first forward after flush() or discard(), after 1 update(s)" in errors[-1]
        assert "the micro-step after 2, which closes the window, after 2 update(s)" in errors[-1]


@pytest.mark.slow
def test_ddp_static_graph_resumes_mid_window(results: list[dict[str, Any]]) -> None:
    for straight, resumed, updates in (r["static_graph_resume"] for r in results):
        assert updates == 2
        assert_close(resumed, straight)  # to rounding: the first pass after the load syncs
        assert_close(resumed, full_batch([W1, W2]))

"""The ranks agree before any per-rank decision changes what enters the window (2 gloo ranks).

Two spawns: ``disagreements`` (ranks at different points of the window: a clear error on
every rank, never a hang or a gloo abort) and ``agreements`` (the module's own sync setting
given back by flush/discard/dropping the wrapper; the matrix of per-rank decisions, each row
equal on both ranks and to single-process full-batch training in float64).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import scenarios_on_ranks
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from test_ddp_faults import W1, W2, W3, Rows, data, full_batch, grad_scaler_inf_on_one_rank, net

Params = list[list[float]]


def ddp_opt(**kwargs: Any) -> tuple[nn.Module, Any]:
    from accumopt import Accumulate

    ddp = nn.parallel.DistributedDataParallel(net())
    return ddp, Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), model=ddp, **kwargs)


def params(model: nn.Module) -> Params:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def micro(
    rank: int, ddp: nn.Module, opt: Any, rows: Rows, weighted: bool = True, bad: bool = False
) -> None:
    x, y = data()
    a, b = rows[rank]
    loss = ((ddp(x[a:b]) - y[a:b]) ** 2).sum()
    if bad:
        loss = loss * float("inf")
    if weighted:
        opt.backward(loss, items=b - a)
    else:
        (loss / max(b - a, 1)).backward()
    opt.step()
    opt.zero_grad()


def error_of(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except RuntimeError as err:
        return str(err)
    return None


# ---------------------------------------------------------------------- disagreements


def flush_with_different_pending(rank: int, weighted: bool) -> str | None:
    """every=3; rank 0 flushes after 2 micro-steps, rank 1 after 1."""
    ddp, opt = ddp_opt(every=3)

    def go() -> None:
        for rows in W1[: 2 - rank]:
            micro(rank, ddp, opt, rows, weighted)
        opt.flush()

    return error_of(go)


def flush_on_one_rank_only(rank: int, weighted: bool) -> str | None:
    """every=3; rank 0 flushes after 2 micro-steps, rank 1 runs on into the closing one (which
    DDP synchronises itself when unweighted)."""
    ddp, opt = ddp_opt(every=3)

    def go() -> None:
        for rows in W1[:2]:
            micro(rank, ddp, opt, rows, weighted)
        if rank == 0:
            opt.flush()
        else:
            micro(rank, ddp, opt, W1[2], weighted)

    return error_of(go)


def items_window_one_extra_micro_step(rank: int) -> str | None:
    """every_items: rank 0 runs 2 micro-steps, rank 1 runs 1 and flushes."""
    ddp, opt = ddp_opt(every_items=1000)

    def go() -> None:
        for rows in W1[: 2 - rank]:
            micro(rank, ddp, opt, rows)
        if rank == 1:
            opt.flush()

    return error_of(go)


def buffered_window_flush_on_one_rank(rank: int) -> str | None:
    """every=2 with the window buffer (accumopt sums the window): rank 0 flushes after 1
    micro-step, rank 1 closes its window."""
    ddp, opt = ddp_opt(every=2, buffer=True)

    def go() -> None:
        micro(rank, ddp, opt, W1[0], weighted=False)
        if rank == 0:
            opt.flush()
        else:
            micro(rank, ddp, opt, W1[1], weighted=False)

    return error_of(go)


def flush_of_an_empty_window_on_one_rank(rank: int) -> str | None:
    """rank 0 has 1 micro-step pending, rank 1 none: both call flush()."""
    ddp, opt = ddp_opt(every=3)

    def go() -> None:
        if rank == 0:
            micro(rank, ddp, opt, W1[0])
        opt.flush()

    return error_of(go)


DISAGREEMENTS: dict[str, Callable[[int], Any]] = {
    "pending_weighted": lambda r: flush_with_different_pending(r, True),
    "pending_unweighted": lambda r: flush_with_different_pending(r, False),
    "one_rank_weighted": lambda r: flush_on_one_rank_only(r, True),
    "one_rank_unweighted": lambda r: flush_on_one_rank_only(r, False),
    "items": items_window_one_extra_micro_step,
    "buffered": buffered_window_flush_on_one_rank,
    "empty": flush_of_an_empty_window_on_one_rank,
}


@pytest.fixture(scope="module")
def disagreements() -> list[dict[str, Any]]:
    # a short timeout: a rank left waiting must fail the test quickly, not hang it
    return scenarios_on_ranks(__name__, "DISAGREEMENTS", timeout_s=20)


def assert_both_told(results: list[dict[str, Any]], name: str) -> None:
    for rank, r in enumerate(results):
        assert r[name] is not None, f"rank {rank} was not told"
        assert "different points of the accumulation window" in r[name], r[name]
        assert "flush() on every rank together" in r[name]


@pytest.mark.slow
def test_ranks_with_different_micro_step_counts_every_n_weighted_error_on_every_rank(
    disagreements: list[dict[str, Any]],
) -> None:
    assert_both_told(disagreements, "pending_weighted")
    assert_both_told(disagreements, "one_rank_weighted")
    assert "rank 0: flush() with 2 micro-step(s) pending" in disagreements[0]["pending_weighted"]
    assert "rank 1: flush() with 1 micro-step(s) pending" in disagreements[1]["pending_weighted"]


@pytest.mark.slow
def test_ranks_with_different_micro_step_counts_every_n_unweighted_error_on_every_rank(
    disagreements: list[dict[str, Any]],
) -> None:
    assert_both_told(disagreements, "pending_unweighted")
    assert_both_told(disagreements, "one_rank_unweighted")  # before DDP's bucket all-reduce
    assert "which closes the window" in disagreements[1]["one_rank_unweighted"]
    assert_both_told(disagreements, "buffered")


@pytest.mark.slow
def test_ranks_with_different_micro_step_counts_every_items_error_on_every_rank(
    disagreements: list[dict[str, Any]],
) -> None:
    assert_both_told(disagreements, "items")


@pytest.mark.slow
def test_flush_with_an_empty_window_on_one_rank_errors_on_every_rank(
    disagreements: list[dict[str, Any]],
) -> None:
    assert_both_told(disagreements, "empty")


# ---------------------------------------------------------------------- agreements


def synced_grads(rank: int, model: nn.Module) -> Params:
    """A plain backward on this rank's own rows: equal gradients on both ranks iff synced."""
    x, y = data()
    a = 100 + 8 * rank
    for p in model.parameters():
        p.grad = None
    ((model(x[a : a + 8]) - y[a : a + 8]) ** 2).sum().backward()
    return [p.grad.flatten().tolist() for p in model.parameters()]  # type: ignore[union-attr]


def restore_after(rank: int, how: str) -> tuple[bool, Params]:
    """The DDP module's own sync setting after flush()/discard() at a boundary/del opt."""
    ddp, opt = ddp_opt(every=3 if how != "discard" else 2)
    micro(rank, ddp, opt, W1[0], weighted=False)
    if how == "flush":
        micro(rank, ddp, opt, W1[1], weighted=False)
        opt.flush()
    elif how == "discard":  # the closing micro-step, then discard instead of step
        x, y = data()
        a, b = W1[1][rank]
        (((ddp(x[a:b]) - y[a:b]) ** 2).sum() / (b - a)).backward()
        assert opt.will_update
        opt.discard()
    else:
        gc.disable()  # the wrapper goes by reference counting alone
        del opt
        gc.enable()
    flag = bool(ddp.require_backward_grad_sync)
    return flag, synced_grads(rank, ddp)


def fsdp_restore_after(rank: int, how: str) -> list[bool]:
    """FSDP2: after flush() of a closed window / del opt mid-window, a plain backward
    reduce-scatters (each FSDP unit writes its sharded .grad)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accumopt import Accumulate

    model = net()
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, model=model)
    x, y = data()
    inside = []
    for j, rows in enumerate(W1 if how == "flush" else W1[:1]):
        a, b = rows[rank]
        (((model(x[a:b]) - y[a:b]) ** 2).sum() / (b - a)).backward()
        if j == 0:  # inside the window: unsharded gradients, not reduced yet
            inside = [p.grad is None for p in model.parameters()]
        if j < 2:
            opt.step()
    if how == "flush":  # the closed window (a partial one lives in FSDP2's unsharded buffers)
        opt.flush()
    else:
        del opt
    for p in model.parameters():
        p.grad = None
    a = 100 + 8 * rank
    ((model(x[a : a + 8]) - y[a : a + 8]) ** 2).sum().backward()
    return [all(inside)] + [p.grad is not None for p in model.parameters()]


def skip_window_inf_on_one_rank(rank: int) -> tuple[Params, int]:
    ddp, opt = ddp_opt(every=3, nonfinite="skip_window")
    for w, window in enumerate((W1, W2, W3)):
        for j, rows in enumerate(window):
            micro(rank, ddp, opt, rows, bad=(w, j, rank) == (0, 1, 0))
    return params(ddp), opt.updates


ZERO = [[(0, 2), (5, 5)], [(10, 13), (15, 16)], [(20, 24), (25, 25)]]  # rank 1: 2 empty
NONE = [[(0, 0), (5, 5)], [(10, 10), (15, 15)], [(20, 20), (25, 25)]]  # no item anywhere


def windows_of(rank: int, windows: list[list[Rows]]) -> tuple[Params, int]:
    ddp, opt = ddp_opt(every=3)
    for window in windows:
        for rows in window:
            micro(rank, ddp, opt, rows)
    return params(ddp), opt.updates


def auto_oom_on_one_rank(rank: int) -> Any:
    from test_ddp import worker

    return worker(rank, "equal", "auto_oom")[:2]


def items_without_the_ddp_model(rank: int) -> list[str | None]:
    """DDP without model=: items would be this rank's own (each rank dividing by its own
    count); refused before the pass, through opt.backward and next_items; set_model fixes it."""
    from accumopt import Accumulate

    ddp = nn.parallel.DistributedDataParallel(net())
    opt = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every=2)
    x, y = data()
    loss = ((ddp(x[:2]) - y[:2]) ** 2).sum()
    messages: list[str | None] = []
    for call in (lambda: opt.backward(loss, items=2), lambda: opt.next_items(2)):
        try:
            call()
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    opt.set_model(ddp)
    opt.backward(loss, items=2)  # now summed over the ranks
    messages.append(str(opt.micro_step))
    return messages


def auto_runner_then_plain(rank: int) -> tuple[Params, int]:
    """The "auto" runner keeps counting back only while it runs: a plain micro-step after it
    on the same wrapper is counted (rank r: rows 8r..8r+4 through the runner, 8r+4..8r+8 by
    hand; one window of 16 items over both ranks)."""
    from accumopt import Accumulate, MicroBatchRunner

    ddp = nn.parallel.DistributedDataParallel(net())
    opt = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every_items=16, model=ddp)
    runner = MicroBatchRunner(opt, lambda b: ((ddp(b[0]) - b[1]) ** 2).sum(), loss_reduction="sum")
    (x, y), a = data(), 8 * rank
    runner((x[a : a + 4], y[a : a + 4]))
    opt.next_items(4)
    ((ddp(x[a + 4 : a + 8]) - y[a + 4 : a + 8]) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()
    return params(ddp), opt.updates


def fixed_runner(rank: int) -> tuple[Params, int]:
    """The fixed-size runner over windows of 16 items on both ranks (rank r: rows 16w + 8r to
    16w + 8r + 8 of window w, 4 micro-batches of 2): every micro-step's items are summed over
    the ranks, so each window closes after its fourth micro-step on both."""
    from accumopt import Accumulate, MicroBatchRunner

    ddp = nn.parallel.DistributedDataParallel(net())
    opt = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every_items=16, model=ddp)
    runner = MicroBatchRunner(
        opt, lambda b: ((ddp(b[0]) - b[1]) ** 2).sum(), micro_batch_size=2, loss_reduction="sum"
    )
    x, y = data()
    for w in range(2):
        a = 16 * w + 8 * rank
        runner((x[a : a + 8], y[a : a + 8]))
        assert opt.micro_step == 0 and opt.updates == w + 1, (opt.micro_step, opt.updates)
    return params(ddp), opt.updates


AGREEMENTS: dict[str, Callable[[int], Any]] = {
    "restore_flush": lambda r: restore_after(r, "flush"),
    "restore_discard": lambda r: restore_after(r, "discard"),
    "restore_del": lambda r: restore_after(r, "del"),
    "fsdp_flush": lambda r: fsdp_restore_after(r, "flush"),
    "fsdp_del": lambda r: fsdp_restore_after(r, "del"),
    "scaler_inf": grad_scaler_inf_on_one_rank,
    "skip_window": skip_window_inf_on_one_rank,
    "zero_items": lambda r: windows_of(r, [ZERO, W2]),
    "no_items": lambda r: windows_of(r, [W1, NONE, W3]),
    "auto_oom": auto_oom_on_one_rank,
    "items_without_model": items_without_the_ddp_model,
    "auto_then_plain": auto_runner_then_plain,
    "fixed_runner": fixed_runner,
}


@pytest.fixture(scope="module")
def agreements() -> list[dict[str, Any]]:
    return scenarios_on_ranks(__name__, "AGREEMENTS", timeout_s=30)


def assert_exact(got: Params, expected: Params) -> None:
    for p, q in zip(got, expected):
        torch.testing.assert_close(
            torch.tensor(p, dtype=torch.float64),
            torch.tensor(q, dtype=torch.float64),
            rtol=1e-12,
            atol=1e-14,
        )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flush", "discard", "del"])
def test_restore_the_modules_own_sync_setting_when_the_wrapper_is_done_with_it(
    agreements: list[dict[str, Any]], how: str
) -> None:
    (flag0, grads0), (flag1, grads1) = (r[f"restore_{how}"] for r in agreements)
    assert flag0 and flag1
    assert grads0 == grads1  # averaged across ranks: DDP synchronised the plain backward


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flush", "del"])
def test_restore_fsdp2_gradient_sync_when_the_wrapper_is_done_with_it(
    agreements: list[dict[str, Any]], how: str
) -> None:
    for r in agreements:
        inside, *reduced = r[f"fsdp_{how}"]
        assert inside  # inside the window: no reduce-scatter
        assert all(reduced)  # after: every FSDP unit reduce-scattered its gradients


@pytest.mark.slow
def test_agreement_matrix_grad_scaler_inf_on_one_rank(agreements: list[dict[str, Any]]) -> None:
    (p0, s0, u0), (p1, s1, u1) = (r["scaler_inf"] for r in agreements)
    assert p0 == p1 and s0 == s1 and u0 == u1 == 2
    assert_exact(p0, full_batch([W2, W3]))


@pytest.mark.slow
def test_agreement_matrix_runner_oom_on_one_rank_backs_off_on_both(
    agreements: list[dict[str, Any]],
) -> None:
    from test_ddp import reference

    (p0, s0), (p1, s1) = (r["auto_oom"] for r in agreements)
    assert p0 == p1 and s0 == s1 and s0["size"] <= 5
    expected = [p.flatten().tolist() for p in reference("equal", weighted=True)]
    assert_exact(p0, expected)


def test_ddp_items_without_the_ddp_model_are_refused_until_set_model(
    agreements: list[dict[str, Any]],
) -> None:
    for r in agreements:
        backward, next_items, after = r["items_without_model"]
        for message in (backward, next_items):
            assert message is not None and "opt.set_model(ddp_model)" in message
        assert after == "1"


@pytest.mark.slow
def test_a_plain_micro_step_after_the_auto_runner_is_counted(
    agreements: list[dict[str, Any]],
) -> None:
    (p0, u0), (p1, u1) = (r["auto_then_plain"] for r in agreements)
    assert p0 == p1 and u0 == u1 == 1
    assert_exact(p0, full_batch([[[(0, 4), (8, 12)], [(4, 8), (12, 16)]]]))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "windows"),
    [
        ("skip_window", [W2, W3]),  # an inf on one rank: both skip that window
        ("zero_items", [ZERO, W2]),  # zero items on one rank
        ("no_items", [W1, W3]),  # a weighted window with no item anywhere is skipped
        # the fixed-size runner: every micro-step's items summed over the ranks
        ("fixed_runner", [[[(0, 8)], [(8, 16)]], [[(16, 24)], [(24, 32)]]]),
    ],
)
def test_both_ranks_apply_the_same_two_full_batch_updates(
    agreements: list[dict[str, Any]], scenario: str, windows: list[list[Rows]]
) -> None:
    (p0, u0), (p1, u1) = (r[scenario] for r in agreements)
    assert p0 == p1 and u0 == u1 == 2
    assert_exact(p0, full_batch(windows))

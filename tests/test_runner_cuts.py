"""MicroBatchRunner cuts a micro-batch at the wrapper's accumulation boundary.

With ``Accumulate(..., every_items=N)`` a window closes at the micro-step whose running item
total reaches N. The runner counts one item per row unless ``loss_fn`` reports its own count,
so in one process it cuts a micro-batch where the window fills: every update then covers
exactly N rows of the stream, whatever the batches, the micro-batch size or the size search
found (before, a micro-batch that overshot brought all its rows in, and the effective batch
followed the micro-batch size). Every case is checked in float64 against plain full-batch
steps over exactly those rows.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys

import pytest
import torch
from helpers import assert_same_params, data, full_batch_step, mlp, twins
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner
from accumopt.testing import run_ranks, simulate_oom

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import this module

pytestmark = pytest.mark.filterwarnings("ignore:accumopt. micro-batches of:UserWarning")

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.05),
}


@settings(max_examples=30, deadline=None)
@given(
    every_items=st.integers(2, 17),
    batches=st.lists(st.integers(1, 23), min_size=1, max_size=5),
    micro=st.one_of(st.integers(1, 9), st.just("auto")),
    limit=st.integers(1, 9),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
)
# the longest run the strategy draws that failed a fixed 1e-12 bound (6e-12 after 32 updates)
@example(every_items=2, batches=[1, 17, 23, 23], micro="auto", limit=1, optimizer="SGD")
def test_every_update_covers_exactly_n_rows_of_the_stream(
    every_items: int, batches: list[int], micro: int | str, limit: int, optimizer: str
) -> None:
    """Batches of any sizes, a fixed micro-batch size or ``"auto"`` under a memory limit of
    ``limit`` rows: the updates are the full-batch steps over rows 0:N, N:2N, ... of the
    concatenated batches; a partial last window is not applied; no micro-batch passes the
    fixed size (or, with ``"auto"``, the limit) and none crosses a window's end."""
    ref, model = (m.double() for m in twins(mlp(140)))
    x, y = (t.double() for t in data(140, sum(batches)))
    acc = Accumulate(OPTIMIZERS[optimizer](model.parameters()), every_items=every_items)
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    pieces: list[tuple[int, int]] = []  # (rows, updates before it), each micro-batch run

    def loss_fn(b: tuple[Tensor, Tensor]) -> Tensor:
        pieces.append((len(b[0]), acc.updates))
        return ((model(b[0]) - b[1]) ** 2).sum()

    runner = MicroBatchRunner(
        acc, loss_fn, micro_batch_size=micro, model=model, loss_reduction="sum"
    )  # type: ignore[arg-type]
    with simulate_oom(model, limit if micro == "auto" else sum(batches)):
        for start, rows in zip(itertools.accumulate([0, *batches]), batches):
            runner((x[start : start + rows], y[start : start + rows]))
    updates = sum(batches) // every_items
    assert acc.updates == updates
    for w in range(updates):
        sl = slice(w * every_items, (w + 1) * every_items)
        full_batch_step(ref, ref_opt, x[sl], y[sl])
    # rounding: the micro-batch sums and the full-batch sums differ in the last bits, and
    # momentum carries each update's difference on, so the bound grows with the updates
    assert_same_params(model, ref, atol=1e-12 * max(1, updates))
    cap = limit if micro == "auto" else micro
    ran = [(rows, w) for rows, w in pieces if rows <= cap]  # "auto": the attempts that fit
    assert sum(rows for rows, _ in ran) == sum(batches)
    for w in range(updates):  # each window: exactly its rows, micro-batches within it
        assert sum(rows for rows, at in ran if at == w) == every_items


def test_items_other_than_rows_close_each_window_at_its_first_micro_step_past_n() -> None:
    """``loss_fn`` counts items of its own (1-3 tokens per row): a cut at the rows the window
    needs at one item per row still closes it (each row carries an item or more), at the
    micro-step that reaches N as without a cut; the updates are token-weighted full-batch
    steps over the rows of each window, exactly."""
    ref, model = (m.double() for m in twins(mlp(141)))
    x, y = (t.double() for t in data(141, 90))
    tokens = torch.arange(90).remainder(3).add(1).double()  # 1, 2, 3, 1, ...
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=20)
    windows: list[list[tuple[int, int]]] = [[]]  # per window: (first row, rows) of each piece
    offset = [0]

    def loss_fn(b: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        xb, yb, tb = b
        if acc.updates == len(windows):
            windows.append([])
        windows[acc.updates].append((offset[0], len(xb)))
        offset[0] += len(xb)
        return (tb[:, None] * (model(xb) - yb) ** 2).sum(), tb.sum()

    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size=7, loss_reduction="sum")
    for start in range(0, 90, 30):
        runner((x[start : start + 30], y[start : start + 30], tokens[start : start + 30]))
    assert acc.updates >= 1
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for pieces in windows[: acc.updates]:
        first, last = pieces[0][0], pieces[-1][0] + pieces[-1][1]
        t = tokens[first:last]
        assert t.sum() >= 20 > t.sum() - tokens[pieces[-1][0] : last].sum()  # first past N
        assert all(rows <= 7 for _, rows in pieces)
        ref_opt.zero_grad()
        ((t[:, None] * (ref(x[first:last]) - y[first:last]) ** 2).sum() / t.sum()).backward()
        ref_opt.step()
    assert_same_params(model, ref)


def test_a_window_in_micro_steps_is_never_cut() -> None:
    """``every=k`` counts micro-steps: the runner keeps its fixed size (the last piece of a
    batch may be shorter), and the update is the mean over the k micro-batches."""
    model: nn.Module = mlp(142).double()
    x, y = (t.double() for t in data(142, 10))
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    sizes: list[int] = []

    def loss_fn(b: tuple[Tensor, Tensor]) -> Tensor:
        sizes.append(len(b[0]))
        return ((model(b[0]) - b[1]) ** 2).mean()

    MicroBatchRunner(acc, loss_fn, micro_batch_size=4, loss_reduction="mean")((x, y))
    assert sizes == [4, 4, 2] and acc.updates == 1


def ddp_worker(rank: int, micro: int | str) -> list[list[float]]:
    """One of 2 ranks: a float64 DDP model, ``every_items=10`` over the ranks, two batches of
    7 rows per rank, micro-batches of ``micro`` rows (``"auto"``: rank 0 runs out of memory
    above 2 rows)."""
    torch.set_default_dtype(torch.float64)  # as in the parent (conftest): the same model
    base = mlp(143).double()
    x, y = (t.double() for t in data(143, 28))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    acc = Accumulate(torch.optim.SGD(ddp.parameters(), lr=0.1), every_items=10, model=ddp)
    runner = MicroBatchRunner(
        acc, lambda b: ((ddp(b[0]) - b[1]) ** 2).sum(), micro_batch_size=micro, loss_reduction="sum"
    )  # type: ignore[arg-type]
    mine = slice(14 * rank, 14 * rank + 14)
    with simulate_oom(ddp.module, 2 if rank == 0 and micro == "auto" else 100):
        for start in (0, 7):
            runner((x[mine][start : start + 7], y[mine][start : start + 7]))
    assert acc.updates == 2, acc.updates
    return [p.detach().flatten().tolist() for p in ddp.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("micro", [3, "auto"])
def test_under_ddp_each_window_holds_n_rows_over_the_ranks(micro: int | str) -> None:
    """2 gloo ranks, each running the same rows per batch: the window of 10 items takes 5
    rows of each rank (rows 5w:5w+5 of its own stream), the same cut on every rank (the
    window's item total is agreed), with a fixed size or "auto" backing off on one rank."""
    results = run_ranks(ddp_worker, micro, world_size=2)
    ref = mlp(143).double()
    x, y = (t.double() for t in data(143, 28))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for w in range(2):
        rows = torch.cat([torch.arange(5 * w, 5 * w + 5) + 14 * r for r in range(2)])
        full_batch_step(ref, opt, x[rows], y[rows])
    for params in results:
        for p, q in zip(params, ref.parameters()):
            torch.testing.assert_close(torch.tensor(p, dtype=torch.float64), q.detach().flatten())


def test_the_search_starts_at_the_first_batch_not_at_a_cut() -> None:
    """A first runner call that opens inside a window (a plain micro-step before it) cuts its
    first micro-batch at the window's room; the size search still starts at the batch's rows,
    so the first batch of new inputs runs whole, not from the cut upward."""
    model: nn.Module = mlp(144).double()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    sizes: list[int] = []

    def loss_fn(b: tuple[Tensor, Tensor]) -> Tensor:
        sizes.append(len(b[0]))
        return ((model(b[0].mean(dim=2)) - b[1]) ** 2).sum()

    x, y = (t.double() for t in data(144, 23))
    acc.backward(((model(x[:1]) - y[:1]) ** 2).sum(), items=1)
    acc.step()
    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size="auto", loss_reduction="sum")
    runner((x[1:16, :, None].expand(-1, -1, 3), y[1:16]))  # 15 rows: cut at 7, then 8
    assert sizes == [7, 8] and acc.updates == 2
    sizes.clear()
    runner((x[15:23, :, None].expand(-1, -1, 5), y[15:23]))  # new inputs: a search from 15
    assert sizes == [8] and acc.updates == 3

"""MicroBatchRunner with ``budget=TokenBudget(...)``: micro-batches cut by their tokens.

A small causal token model in float64 (an embedding summed along the sequence, so a position
sees only those before it: trimming the right padding changes nothing). Every update is
checked against plain full-batch steps on the mean over the loss-bearing tokens of exactly the
window's rows: ``rows_per_update=N`` rows of the stream (``every_items=math.inf``), or the rows
up to the one at which the tokens reach ``every_items=T``.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_params
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner, NoMicroBatchFits, PerSample, TokenBudget
from accumopt.budget import plan, window_end
from accumopt.runner import _per_rank, _same_rows
from accumopt.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))  # the ranks import this module

pytestmark = pytest.mark.filterwarnings("ignore:accumopt. micro-batches of:UserWarning")

VOCAB, PAD = 11, 0


class TokenLM(nn.Module):
    """Embeddings summed causally along the sequence, then a linear head per position."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 4, dtype=torch.float64)
        self.head = nn.Linear(4, VOCAB, dtype=torch.float64)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(ids).cumsum(1)))


def make_batch(lengths: list[int], width: int, seed: int) -> dict[str, Tensor]:
    """Rows of ``lengths`` tokens right-padded to ``width``; a prompt of up to half of each row
    bears no loss (label -100), as in instruction tuning."""
    g = torch.Generator().manual_seed(seed)
    n, lens = len(lengths), torch.tensor(lengths)
    ids = torch.randint(1, VOCAB, (n, width), generator=g)
    real = torch.arange(width)[None] < lens[:, None]
    prompt = torch.arange(width)[None] < (lens // 2 * torch.rand(n, generator=g)).long()[:, None]
    labels = torch.where(real & ~prompt, torch.randint(0, VOCAB, (n, width), generator=g), -100)
    return {"ids": torch.where(real, ids, PAD), "labels": labels, "lengths": lens}


def loss_sum(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def tokens_of(batch: dict[str, Tensor]) -> Tensor:
    """The loss-bearing tokens of each row (on the host)."""
    return (batch["labels"] != -100).sum(1)


def lengths_of(batch: dict[str, Tensor]) -> Tensor:
    return batch["lengths"]


def cat(batches: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def reference_windows(stream: dict[str, Tensor], window: str, size: int) -> list[range]:
    """The rows of each complete window of the stream: ``size`` rows, or the rows up to the one
    at which the loss-bearing tokens reach ``size``."""
    if window == "rows":
        n = len(stream["lengths"]) // size
        return [range(w * size, (w + 1) * size) for w in range(n)]
    out, start, total = [], 0, 0
    for row, t in enumerate(tokens_of(stream).tolist()):
        total += t
        if total >= size:
            out.append(range(start, row + 1))
            start, total = row + 1, 0
    return out


def train_reference(
    model: nn.Module, stream: dict[str, Tensor], windows: list[range], lr: float = 0.1
) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for rows in windows:
        part = {key: value[rows.start : rows.stop] for key, value in stream.items()}
        opt.zero_grad()
        tokens = int(tokens_of(part).sum())
        if tokens == 0:  # the wrapper skips a window of no items
            continue
        (loss_sum(model, part) / tokens).backward()
        opt.step()


class TokenLimit:
    """Out of memory in the model's forward pass for inputs of more than ``limit`` tokens
    (rows x padded length), as a device would; records every call's (rows, length)."""

    def __init__(self, model: nn.Module, limit: int) -> None:
        self.limit, self.calls, self.raised = limit, list[tuple[int, int]](), 0
        self._handle = model.register_forward_pre_hook(self._check)

    def _check(self, _: nn.Module, args: tuple[Any, ...]) -> None:
        rows, length = args[0].shape
        self.calls.append((rows, length))
        if rows * length > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(f"out of memory (simulated): {rows} x {length} tokens")

    def remove(self) -> None:
        self._handle.remove()


def make_runner(
    model: nn.Module, window: str, size: int, tokens: int | str, **budget: Any
) -> tuple[Accumulate, MicroBatchRunner]:
    every_items = math.inf if window == "rows" else size
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulate(sgd, every_items=every_items, model=model)
    spec = TokenBudget(
        tokens,  # type: ignore[arg-type]
        cost=lengths_of,
        items=tokens_of,
        rows_per_update=size if window == "rows" else None,
        **{"padded": True, **budget},
    )
    runner = MicroBatchRunner(
        acc, lambda b: loss_sum(model, b), budget=spec, model=model, loss_reduction="sum"
    )
    return acc, runner


@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(1, 16), min_size=1, max_size=12), min_size=1, max_size=3),
    window=st.sampled_from(["rows", "tokens"]),
    size=st.integers(1, 14),
    tokens=st.one_of(st.integers(1, 96), st.just("auto")),
    padded=st.booleans(),
    sort=st.booleans(),
    buckets=st.sampled_from(["pow2", None, (4, 12)]),
    seed=st.integers(0, 100),
)
def test_every_update_is_the_token_mean_of_exactly_its_window(
    batches: list[list[int]],
    window: str,
    size: int,
    tokens: int | str,
    padded: bool,
    sort: bool,
    buckets: Any,
    seed: int,
) -> None:
    """Random lengths, budgets (fixed, or "auto" under a memory limit of 40 tokens), windows of
    ``size`` rows or ``4 * size`` loss-bearing tokens, padded and packed costs, sorted or not:
    the parameters are those of full-batch steps on the token mean of each complete window."""
    size = size if window == "rows" else 4 * size
    model, ref = TokenLM(seed), TokenLM(seed)
    data = [make_batch(lengths, 16, seed + k) for k, lengths in enumerate(batches)]
    acc, runner = make_runner(
        model, window, size, tokens, padded=padded, sort=sort, buckets=buckets
    )
    limit = TokenLimit(model, 40 if tokens == "auto" else 10**9)
    for batch in data:
        runner(batch)
    limit.remove()
    stream = cat(data)
    windows = reference_windows(stream, window, size)
    train_reference(ref, stream, windows)
    assert acc.updates == sum(int(tokens_of(stream)[w.start : w.stop].sum()) > 0 for w in windows)
    assert_same_params(model, ref, atol=1e-12 * max(1, len(windows)))
    tally = runner.tally
    assert tally is not None and tally.rows == len(stream["lengths"])
    assert tally.failed == limit.raised == runner.ooms


def test_a_window_of_n_sequences_holds_exactly_n() -> None:
    """256 sequences per update in batches of 100, weighted by their tokens: every update holds
    exactly 256 rows, whatever the budget cuts (the issue's 19-updates-for-20 overshoot)."""
    model = TokenLM(1)
    acc, runner = make_runner(model, "rows", 256, 256, sort=True)
    ran: list[tuple[int, int]] = []  # (rows, updates before it) of each micro-batch
    model.register_forward_pre_hook(lambda _, args: ran.append((len(args[0]), acc.updates)))
    g = torch.Generator().manual_seed(0)
    for k in range(20 * 256 // 100 + 1):
        lengths = (torch.rand(100, generator=g) ** 3 * 31 + 1).long().tolist()  # long-tailed
        runner(make_batch(lengths, 32, k))
    assert acc.updates == 20
    assert [sum(r for r, at in ran if at == w) for w in range(20)] == [256] * 20
    assert acc.micro_step > 0  # the rows after the 20th window wait in the open window


def test_a_window_in_tokens_ends_at_the_row_that_reaches_them() -> None:
    """every_items=T in loss-bearing tokens: a micro-batch never runs past the row at which
    the window's tokens reach T, so each window holds T up to that row's tokens less one."""
    model = TokenLM(2)
    acc, runner = make_runner(model, "tokens", 50, 96)
    totals: list[float] = []
    acc.register_update_hook(lambda opt, report: totals.append(report.items))
    batch = make_batch([9, 3, 16, 12, 1, 7, 16, 5, 11, 2, 14, 6] * 3, 16, 5)
    runner(batch)
    windows = reference_windows(batch, "tokens", 50)
    assert totals == [float(tokens_of(batch)[w.start : w.stop].sum()) for w in windows]
    per_row = tokens_of(batch).tolist()
    for w, total in zip(windows, totals):
        assert 50 <= total < 50 + per_row[w.stop - 1]


def test_a_sorted_window_in_tokens_runs_the_row_that_reaches_them_last() -> None:
    """every_items=10 over rows of 2, 2, 16, 3 and 3 loss-bearing tokens: the first window is
    rows 0-2. Longest first, row 2 would run first (with row 0) and the wrapper would close
    the window at 18 tokens, row 1 going to the next one; it runs in the last micro-batch."""
    model, ref = TokenLM(12), TokenLM(12)
    acc, runner = make_runner(model, "tokens", 10, 64, sort=True)
    batch = make_batch([2, 2, 16, 3, 3], 16, 0)
    batch["labels"] = torch.where(torch.arange(16)[None] < batch["lengths"][:, None], 1, -100)
    totals: list[float] = []
    acc.register_update_hook(lambda opt, report: totals.append(report.items))
    runner(batch)
    assert totals == [20.0]
    train_reference(ref, batch, reference_windows(batch, "tokens", 10))
    assert_same_params(model, ref)


def test_padded_leaves_are_cut_to_the_micro_batch_length_and_nothing_else() -> None:
    """padded=True: the dense leaves whose dim 1 is the batch's padded length 32 (ids, labels,
    per-token features) reach loss_fn cut to the micro-batch's longest row rounded up to a
    power of two; the other leaves (lengths, a feature of 3, a note) keep their dims."""
    model = TokenLM(3)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=math.inf)
    seen: list[dict[str, Any]] = []

    def loss_fn(b: dict[str, Any]) -> Tensor:
        seen.append({k: tuple(v.shape) if isinstance(v, Tensor) else v for k, v in b.items()})
        return loss_sum(model, b)

    spec = TokenBudget(40, cost=lengths_of, padded=True, items=tokens_of)
    runner = MicroBatchRunner(acc, loss_fn, budget=spec, loss_reduction="sum")
    batch = make_batch([3, 5, 17, 20, 2, 2, 2, 2], 32, 0)
    runner({**batch, "pair": torch.zeros(8, 32, 2), "feature": torch.zeros(8, 3), "note": "n"})
    assert [s["ids"] for s in seen] == [(2, 8), (1, 32), (1, 32), (4, 2)]
    for s in seen:
        rows, length = s["ids"]
        assert s["labels"] == (rows, length) and s["pair"] == (rows, length, 2)
        assert s["lengths"] == (rows,) and s["feature"] == (rows, 3) and s["note"] == "n"
    tally = runner.tally
    assert tally is not None and tally.shapes == {(2, 8), (1, 32), (4, 2)}
    assert tally.computed == 16 + 32 + 32 + 8 and tally.tokens == 53


def test_trim_names_the_padded_leaves_when_a_feature_is_wider() -> None:
    """A per-row feature of 64 beside ids padded to 32: without trim= the runner cannot tell
    which leaves are padded and refuses before running anything; with trim= it cuts ids and
    labels only, the feature reaches loss_fn whole, and the update is the full-batch one."""
    model, ref = TokenLM(6), TokenLM(6)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulate(sgd, every_items=math.inf)
    widths: list[int] = []

    def loss_fn(b: dict[str, Any]) -> Tensor:
        widths.append(b["feature"].shape[1])
        return loss_sum(model, b)

    batch = {**make_batch([3, 5, 17, 20, 2, 2, 2, 2], 32, 0), "feature": torch.zeros(8, 64)}
    for trim in (None, ("ids", "labels")):
        spec = TokenBudget(40, cost=lengths_of, padded=True, items=tokens_of, trim=trim)
        runner = MicroBatchRunner(acc, loss_fn, budget=spec, loss_reduction="sum")
        if trim is None:
            with pytest.raises(ValueError, match=r"batch\['ids'\] has dim 1 of 32, as long as"):
                runner(batch)
            assert acc.micro_step == 0 and widths == []
        else:
            runner(batch)
    assert acc.flush() and widths == [64] * 4
    train_reference(ref, batch, [range(8)])
    assert_same_params(model, ref)


def test_a_torch_compiled_model_sees_few_shapes() -> None:
    """Long-tailed random lengths in 12 batches of 64 rows: with the default buckets the
    micro-batches come in a few shapes (powers of two: rows x padded length); cut exactly,
    in many more."""
    counts = {}
    for buckets in ("pow2", None):
        model = TokenLM(4)
        acc, runner = make_runner(model, "rows", 64, 256, buckets=buckets, sort=True)
        g = torch.Generator().manual_seed(1)
        for k in range(12):
            lengths = (torch.rand(64, generator=g) ** 4 * 127 + 1).long().tolist()
            runner(make_batch(lengths, 128, k))
        assert acc.updates == 12
        assert runner.tally is not None
        counts[buckets] = len(runner.tally.shapes)
    assert counts["pow2"] <= 12, counts  # 8 padded lengths 1..128, a few row counts each
    assert counts[None] > 3 * counts["pow2"], counts


def test_auto_budget_survives_out_of_memory_and_reports_its_cost() -> None:
    """ "auto" under a limit of 100 tokens: every sample once (the update is exact), the failed
    attempts counted and their tokens reported as wasted; the search settles in the budget's
    unit."""
    model, ref = TokenLM(5), TokenLM(5)
    acc, runner = make_runner(model, "rows", 32, "auto", sort=True)
    limit = TokenLimit(model, 100)
    data = [make_batch((torch.arange(32) % 16 + 1).tolist(), 16, k) for k in range(3)]
    for batch in data:
        runner(batch)
    limit.remove()
    stream = cat(data)
    train_reference(ref, stream, reference_windows(stream, "rows", 32))
    assert acc.updates == 3
    assert_same_params(model, ref)
    tally = runner.tally
    assert tally is not None and tally.failed == runner.ooms == limit.raised > 0
    failed = [(r, n) for r, n in limit.calls if r * n > 100]
    assert tally.wasted == sum(r * n for r, n in failed)
    assert max(r * n for r, n in limit.calls if r * n <= 100) <= 100
    assert runner.micro_batch_size is not None and runner.micro_batch_size <= 100
    assert runner.history[0][2] == "first"


def test_auto_budget_with_a_grad_scaler_under_out_of_memory() -> None:
    """A GradScaler given to the wrapper scales and steps every micro-batch; the windows the
    runner flushes after 12 rows are the full-batch token means, failed attempts dropped."""
    model, ref = TokenLM(10), TokenLM(10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    acc = Accumulate(
        torch.optim.AdamW(model.parameters(), lr=0.01), every_items=math.inf, scaler=scaler
    )
    spec = TokenBudget("auto", cost=lengths_of, items=tokens_of, padded=True, rows_per_update=12)
    runner = MicroBatchRunner(acc, lambda b: loss_sum(model, b), budget=spec, loss_reduction="sum")
    limit = TokenLimit(model, 30)
    batch = make_batch([4, 9, 1, 16, 3, 3, 12, 5, 8, 2, 7, 6], 16, 6)
    runner(batch)
    limit.remove()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    (loss_sum(ref, batch) / tokens_of(batch).sum()).backward()
    ref_opt.step()
    assert acc.updates == 1 and runner.ooms > 0
    assert_same_params(model, ref)


def test_a_row_that_alone_runs_out_of_memory_is_a_clear_error() -> None:
    model = TokenLM(6)
    acc, runner = make_runner(model, "rows", 4, "auto")
    limit = TokenLimit(model, 10)
    with pytest.raises(NoMicroBatchFits, match=r"micro-batch of 1 sample ran out of memory"):
        runner(make_batch([3, 12, 2, 2], 16, 0))
    limit.remove()
    assert acc.micro_step == 1  # the first row ran; the window waits for the rest


def test_outputs_come_in_the_batch_order_and_sorted_rows_refuse_them() -> None:
    """return_outputs joins the outputs in the batch's order (here one per row: the row's summed
    loss); with sort=True the rows run in another order, which outputs of any shape (per token,
    PerSample, ...) cannot always be put back from: refused before anything runs."""
    model = TokenLM(7)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=1000)

    def loss_fn(b: dict[str, Tensor]) -> tuple[Tensor, None, Tensor]:
        per_row = F.cross_entropy(
            model(b["ids"]).transpose(1, 2), b["labels"], reduction="none"
        ).sum(1)
        return per_row.sum(), None, per_row.detach()

    batch = make_batch([2, 9, 4, 16, 1, 7, 12, 3], 16, 3)
    expected = F.cross_entropy(
        model(batch["ids"]).transpose(1, 2), batch["labels"], reduction="none"
    )
    spec = TokenBudget(32, cost=lengths_of, padded=False, items=tokens_of, sort=True)
    runner = MicroBatchRunner(acc, loss_fn, budget=spec, loss_reduction="sum")
    with pytest.raises(ValueError, match=r"return_outputs=True with TokenBudget\(sort=True\)"):
        runner(batch, return_outputs=True)
    assert acc.micro_step == 0
    spec = TokenBudget(32, cost=lengths_of, padded=False, items=tokens_of)
    runner = MicroBatchRunner(acc, loss_fn, budget=spec, loss_reduction="sum")
    mean, outputs = runner(batch, return_outputs=True)
    torch.testing.assert_close(outputs, expected.sum(1).detach())
    torch.testing.assert_close(mean, expected.sum() / tokens_of(batch).sum())


def test_costs_shorter_than_the_rows_are_refused_before_anything_runs() -> None:
    """padded=True cuts each row past its cost: a cost shorter than the row (its loss-bearing
    tokens, lengths - 1) would drop real tokens, and a per-row feature exactly as wide as the
    padded length is no padded leaf. Both show as values other than padding past a row's cost
    (checked on the host batch), refused before any micro-batch runs."""
    model = TokenLM(9)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=math.inf)
    batch = make_batch([3, 5, 8, 2], 8, 1)
    for cost, extra in (
        (tokens_of, {}),
        (lambda b: b["lengths"] - 1, {}),
        (lengths_of, {"style": torch.randn(4, 8)}),
    ):
        spec = TokenBudget(16, cost=cost, padded=True, items=tokens_of)
        runner = MicroBatchRunner(
            acc, lambda b: loss_sum(model, b), budget=spec, loss_reduction="sum"
        )
        with pytest.raises(ValueError, match=r"holds other values than one padding value past"):
            runner({**batch, **extra})
        assert acc.micro_step == 0
    spec = TokenBudget(16, cost=lengths_of, padded=True, items=tokens_of, trim=("ids", "labels"))
    runner = MicroBatchRunner(acc, lambda b: loss_sum(model, b), budget=spec, loss_reduction="sum")
    runner({**batch, "style": torch.randn(4, 8)})
    assert acc.flush()


def test_packed_rows_as_per_sample_sequences() -> None:
    """padded=False with variable-length sequences in PerSample lists (a varlen model packs
    them): cut by their summed tokens, gathered longest first, exact."""
    model, ref = TokenLM(8), TokenLM(8)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    seqs = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    targets = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=math.inf)

    def packed(m: nn.Module, b: dict[str, Any]) -> Tensor:
        out = [m(s[None])[0] for s in b["seqs"]]
        return F.cross_entropy(torch.cat(out), torch.cat(list(b["targets"])), reduction="sum")

    spec = TokenBudget(
        12,
        cost=lambda b: [len(s) for s in b["seqs"].value],
        items=lambda b: [len(t) for t in b["targets"].value],
        padded=False,
        sort=True,
        rows_per_update=8,
    )
    sizes: list[list[int]] = []
    runner = MicroBatchRunner(
        acc,
        lambda b: sizes.append([len(s) for s in b["seqs"]]) or packed(model, b),
        budget=spec,
        loss_reduction="sum",
    )
    runner({"seqs": PerSample(seqs), "targets": PerSample(targets)})
    assert sizes == [[9], [8], [7, 5], [4, 3, 2, 1]]  # longest first, within 12 tokens each
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (packed(ref, {"seqs": seqs, "targets": targets}) / sum(lengths)).backward()
    opt.step()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_a_mean_loss_over_tokens_is_weighted_by_the_host_counts() -> None:
    """loss_reduction="mean": loss_fn returns cross_entropy's mean over its loss-bearing
    tokens, which the runner weights by TokenBudget.items (a micro-batch of none adds
    nothing): the full-batch token mean."""
    model, ref = TokenLM(9), TokenLM(9)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=math.inf)

    def loss_fn(b: dict[str, Tensor]) -> Tensor:
        logits = model(b["ids"])
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())

    spec = TokenBudget(16, cost=lengths_of, padded=True, items=tokens_of, rows_per_update=6)
    MicroBatchRunner(acc, loss_fn, budget=spec, loss_reduction="mean")(
        make_batch([1, 1, 8, 12, 3, 5], 12, 4)
    )
    batch = make_batch([1, 1, 8, 12, 3, 5], 12, 4)
    (loss_sum(ref, batch) / tokens_of(batch).sum()).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert acc.updates == 1
    assert_same_params(model, ref)


def wrapper(every: Any = None, **kwargs: Any) -> Accumulate:
    params = TokenLM().parameters()
    window = {"every": every} if every is not None else {"every_items": kwargs.pop("items", 64)}
    return Accumulate(torch.optim.SGD(params, lr=0.1), **window, **kwargs)


SPEC = TokenBudget(64, cost=lengths_of, padded=True)


@pytest.mark.parametrize(
    ("build", "exc", "pattern"),
    [
        (
            lambda: MicroBatchRunner(wrapper(), sum, budget=64, loss_reduction="sum"),
            TypeError,
            r"budget=64 is a int; expected an accumopt.TokenBudget",
        ),
        (
            lambda: MicroBatchRunner(
                wrapper(), sum, budget=SPEC, micro_batch_size="auto", loss_reduction="sum"
            ),
            ValueError,
            r"micro_batch_size='auto' with budget=; expected one of them",
        ),
        (
            lambda: MicroBatchRunner(wrapper(every=4), sum, budget=SPEC, loss_reduction="sum"),
            ValueError,
            r"budget= with every=4; expected a window in items",
        ),
        (
            lambda: MicroBatchRunner(
                wrapper(),
                sum,
                budget=TokenBudget(64, cost=lengths_of, padded=True, rows_per_update=8),
                loss_reduction="sum",
            ),
            ValueError,
            r"TokenBudget\(rows_per_update=8\) with every_items=64; expected .*every_items=math",
        ),
    ],
)
def test_budgets_the_runner_cannot_honour_are_refused(
    build: Any, exc: type[Exception], pattern: str
) -> None:
    with pytest.raises(exc, match=r"^MicroBatchRunner: " + pattern):
        build()


def test_items_from_loss_fn_are_refused_with_a_budget() -> None:
    model = TokenLM()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=64)
    runner = MicroBatchRunner(
        acc, lambda b: (loss_sum(model, b), tokens_of(b).sum()), budget=SPEC, loss_reduction="sum"
    )
    with pytest.raises(ValueError, match=r"loss_fn returned items=tensor\(.*\) with budget="):
        runner(make_batch([3, 4], 8, 0))
    assert acc.micro_step == 0


def test_costs_beyond_the_padded_length_are_refused() -> None:
    model = TokenLM()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=64)
    runner = MicroBatchRunner(acc, lambda b: loss_sum(model, b), budget=SPEC, loss_reduction="sum")
    batch = make_batch([3, 4], 8, 0)
    with pytest.raises(ValueError, match=r"a row costs 9, more than the batch's padded length 8"):
        runner({**batch, "lengths": torch.tensor([3, 9])})


def test_a_window_the_runner_did_not_feed_is_refused_with_rows_per_update() -> None:
    model = TokenLM()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=math.inf)
    spec = TokenBudget(64, cost=lengths_of, padded=True, rows_per_update=4)
    runner = MicroBatchRunner(acc, lambda b: loss_sum(model, b), budget=spec, loss_reduction="sum")
    runner(make_batch([3, 4], 8, 0))
    acc.backward(loss_sum(model, make_batch([2], 8, 1)), items=1)
    acc.step()
    with pytest.raises(RuntimeError, match=r"window holds 2 micro-step\(s\) the runner did not"):
        runner(make_batch([3, 4], 8, 2))
    acc.flush()
    runner(make_batch([3, 4, 5, 6], 8, 2))  # a window of its own again
    assert acc.updates == 2 and acc.micro_step == 0
    runner(make_batch([3, 4], 8, 3))  # 2 rows of 4 in one micro-step: the runner's window
    acc.discard()  # then another loop's micro-step of 1 item: as many micro-steps as before
    acc.backward(loss_sum(model, make_batch([2], 8, 4)), items=1)
    acc.step()
    with pytest.raises(RuntimeError, match=r"window holds 1 micro-step\(s\) the runner did not"):
        runner(make_batch([3, 4], 8, 5))


def test_every_items_inf_is_a_window_only_flush_applies() -> None:
    model = TokenLM()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=math.inf)
    for k in range(5):
        acc.backward(loss_sum(model, make_batch([4], 8, k)), items=3)
        acc.step()
    assert acc.updates == 0 and acc.micro_step == 5 and acc.items == 15
    state = copy.deepcopy(acc.state_dict())  # a mid-window checkpoint loads back
    acc.load_state_dict(state)
    assert acc.flush() and acc.updates == 1 and acc.last_window is not None
    assert acc.last_window.items == 15


# --- two gloo ranks ----------------------------------------------------------------------


def rank_batches(rank: int) -> list[dict[str, Tensor]]:
    """Each rank's own two batches of 12 rows, of its own long-tailed lengths."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for k in range(2):
        lengths = (torch.rand(12, generator=g) ** 3 * 15 + 1).long().tolist()
        out.append(make_batch(lengths, 16, 10 * rank + k))
    return out


def steps_alone(batches: list[dict[str, Tensor]], tokens: int, rows: int) -> list[int]:
    """The micro-steps of each window of ``rows`` rows that one rank's own plan runs."""
    spec = TokenBudget(tokens, cost=lengths_of, padded=True, sort=True)
    steps: list[int] = []
    for batch in batches:
        ones = [1] * len(batch["lengths"])
        p = plan(spec, [(batch["lengths"].tolist(), 16)], lambda s, w=ones: window_end(w, s, rows))
        count = 0
        while p.ready():
            p.next(tokens)
            count += 1
            if p.closes:
                steps.append(count)
                count = 0
            p.advance()
    return steps


def ddp_worker(rank: int, window: str, tokens: int | str) -> dict[str, Any]:
    """One of 2 ranks: a DDP model, windows of 8 rows (4 per rank) or 40 tokens over the
    ranks, a budget of ``tokens`` (``"auto"``: rank 0 alone runs out of memory above 40)."""
    torch.set_default_dtype(torch.float64)
    ddp = nn.parallel.DistributedDataParallel(TokenLM(11))
    size = 8 if window == "rows" else 40
    acc, runner = make_runner(ddp, window, size, tokens, sort=True)  # type: ignore[arg-type]
    steps: list[int] = []
    acc.register_update_hook(lambda opt, report: steps.append(report.micro_steps))
    limit = TokenLimit(ddp.module, 40 if rank == 0 and tokens == "auto" else 10**9)
    for batch in rank_batches(rank):
        runner(batch)
    limit.remove()
    assert runner.tally is not None
    return {
        "params": [p.detach().flatten().tolist() for p in ddp.parameters()],
        "steps": steps,
        "updates": acc.updates,
        "ooms": runner.ooms,
    }


@pytest.mark.slow
@pytest.mark.parametrize(("window", "tokens"), [("rows", 24), ("tokens", "auto")])
def test_two_ranks_run_as_many_micro_steps_per_window_and_update_exactly(
    window: str, tokens: int | str
) -> None:
    """2 gloo ranks with different lengths: every window has as many micro-steps on each rank
    (the rank that needs fewer splits its micro-batches), and the update is the full-batch
    token mean over both ranks' rows of the window: rows 4w:4w+4 of each rank's stream, or
    the first rows of both at which the tokens over the ranks reach 40."""
    results = run_ranks(ddp_worker, window, tokens, world_size=2)
    streams = [cat(rank_batches(r)) for r in range(2)]
    assert results[0]["steps"] == results[1]["steps"] and results[0]["updates"] >= 3
    if window == "rows":  # each window: as many micro-steps as the rank that needs most alone
        alone = [steps_alone(rank_batches(r), 24, 4) for r in range(2)]
        assert alone[0] != alone[1]  # the ranks' own plans differ: one splits its micro-batches
        assert results[0]["steps"] == [max(a, b) for a, b in zip(*alone)]
    if tokens == "auto":
        assert results[0]["ooms"] == results[1]["ooms"] > 0  # both ranks backed off together
    position_tokens = tokens_of(streams[0]) + tokens_of(streams[1])
    if window == "rows":
        windows = [range(4 * w, 4 * w + 4) for w in range(6)]
    else:
        ends, start, total = [], 0, 0
        for row, t in enumerate(position_tokens.tolist()):
            total += t
            if total >= 40:
                ends.append(range(start, row + 1))
                start, total = row + 1, 0
        windows = ends
    ref = TokenLM(11)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for rows in windows:
        opt.zero_grad()
        parts = [{k: v[rows.start : rows.stop] for k, v in s.items()} for s in streams]
        tokens_in = sum(int(tokens_of(p).sum()) for p in parts)
        (sum(loss_sum(ref, p) for p in parts) / tokens_in).backward()
        opt.step()
    assert results[0]["updates"] == len(windows)
    for params in (r["params"] for r in results):
        for p, q in zip(params, ref.parameters()):
            torch.testing.assert_close(
                torch.tensor(p), q.detach().flatten(), rtol=1e-10, atol=1e-12
            )


def refusing_worker(rank: int) -> str:
    """One of 2 ranks; rank 1's costs are shorter than its rows (refused by the padding check):
    both ranks raise, neither hangs in the other's collective, nothing ran."""
    torch.set_default_dtype(torch.float64)
    ddp = nn.parallel.DistributedDataParallel(TokenLM(12))
    acc, runner = make_runner(ddp, "rows", 8, 24)
    batch = rank_batches(rank)[0]
    if rank == 1:
        batch = {**batch, "lengths": batch["lengths"] - 1}
    try:
        runner(batch)
    except ValueError as err:
        assert acc.micro_step == 0 and acc.updates == 0
        return str(err)
    return "ran"


@pytest.mark.slow
def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank() -> None:
    own, other = run_ranks(refusing_worker, world_size=2)[::-1]
    assert own.startswith("MicroBatchRunner: batch['ids'] holds other values than one padding")
    assert other.startswith("MicroBatchRunner: another rank refused its TokenBudget counts")


def test_ranks_must_split_each_window_and_the_batch_evenly() -> None:
    """Under 2 ranks (a stand-in for the wrapper's collectives): rows_per_update must be a
    multiple of the ranks, and every rank's batch as many rows (refused on every rank)."""
    ranks = SimpleNamespace(world_size=2, sum_over_ranks=lambda a, b, what: (a + 7.0, b + 49.0))
    with pytest.raises(ValueError, match=r"rows_per_update=9\) over 2 ranks; expected a multiple"):
        _per_rank(ranks, 9)  # type: ignore[arg-type]
    assert _per_rank(ranks, 8) == 4  # type: ignore[arg-type]
    _same_rows(ranks, 7, "budget=")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"this rank's batch has 5 rows, all ranks' 12; .*budget="):
        _same_rows(ranks, 5, "budget=")  # type: ignore[arg-type]

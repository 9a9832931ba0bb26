"""Time per window of ``MicroBatchRunner`` with a token budget against a row cap, on a small
causal transformer over sequences of long-tailed lengths (CPU).

Each window is one call of the runner on 64 sequences of random token ids whose lengths are
log-normal (median 48 tokens, one in ten over about 140, cut at 256), padded to the window's
longest row, as a collator pads a batch. One update per window, the loss averaged over the
window's tokens, plain SGD; the model: 2 pre-norm causal transformer layers of width 64.

- **row cap** (the baseline, twice per round): ``micro_batch_size=8`` rows, every micro-batch
  as long as the window's longest row, ``Accumulate(SGD, every=8)`` weighting each by its
  tokens (``loss_fn`` returns them as an int);
- **token budget**: ``budget=TokenBudget(2048, cost=lengths, items=tokens, padded=True,
  sort=True, rows_per_update=64)`` over ``Accumulate(SGD, every_items=math.inf)``: micro-batches
  of at most 2048 padded tokens (the row cap's largest: 8 x 256), longest rows first, each cut
  to its own padded length rounded up to a power of two (row counts down to one);
- **token budget, exact shapes**: the same with ``buckets=None``.

Rounds, clock, A/A spread and load as in the other benchmarks (``_harness.py``), no target:
the figures reported are the thread-CPU ratio of the window time to the row cap's, each
setting's padding fraction (of the tokens run, the share that was padding), micro-steps per
window and distinct micro-batch shapes, measured on the benchmark's windows beforehand.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _harness import Interleave
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner, TokenBudget

TABLE = "token budget"
ROWS, ROW_CAP, BUDGET, MAX_LEN, VOCAB = 64, 8, 2048, 256, 64
WINDOWS = 8  # distinct windows, cycled
ROUNDS, WARMUP = 21, 2
ROW_CAP_NAME = "row cap, 8 rows"
SETTINGS: dict[str, Any] = {  # name -> buckets of the token budget (False: the row cap)
    ROW_CAP_NAME: False,
    "token budget 2048, pow2 shapes": "pow2",
    "token budget 2048, exact shapes": None,
}


class TinyLM(nn.Module):
    """Two pre-norm causal transformer layers over token embeddings, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.places = nn.Embedding(VOCAB, 64), nn.Embedding(MAX_LEN, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, 0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(64, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        n = ids.shape[1]
        causal = torch.full((n, n), -math.inf, device=ids.device).triu(1)
        h = self.tokens(ids) + self.places.weight[:n]
        return self.out(self.layers(h, mask=causal, is_causal=True))


def windows() -> list[dict[str, Tensor]]:
    """``WINDOWS`` batches of ``ROWS`` rows: ids, labels (-100 where padded), lengths."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(WINDOWS):
        lengths = (torch.randn(ROWS, generator=g) * 0.9 + math.log(48)).exp().clamp(2, MAX_LEN)
        lengths = lengths.long()
        width = int(lengths.max())
        real = torch.arange(width)[None] < lengths[:, None]
        ids = torch.randint(1, VOCAB, (ROWS, width), generator=g) * real
        labels = torch.where(real, torch.randint(0, VOCAB, (ROWS, width), generator=g), -100)
        out.append({"ids": ids, "labels": labels, "lengths": lengths})
    return out


def summed(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def runner_for(
    model: nn.Module, buckets: Any, device: torch.device | None = None, tokens: Any = BUDGET
) -> MicroBatchRunner:
    """The runner of a setting (``buckets`` False: the row cap), its micro-batches moved to
    ``device``; ``tokens``: the budget (``"auto"``: found from out-of-memory errors)."""
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if buckets is False:
        opt = Accumulate(sgd, every=ROWS // ROW_CAP, model=model)

        def loss_fn(b: dict[str, Tensor]) -> tuple[Tensor, int]:
            return summed(model, b), int((b["labels"] != -100).sum())

        return MicroBatchRunner(
            opt, loss_fn, micro_batch_size=ROW_CAP, loss_reduction="sum", model=model, device=device
        )
    spec = TokenBudget(
        tokens,
        cost=lambda b: b["lengths"],
        items=lambda b: (b["labels"] != -100).sum(1),
        padded=True,
        sort=True,
        rows_per_update=ROWS,
        buckets=buckets,
    )
    opt = Accumulate(sgd, every_items=math.inf, model=model)
    return MicroBatchRunner(
        opt,
        lambda b: summed(model, b),
        budget=spec,
        loss_reduction="sum",
        model=model,
        device=device,
    )


def window_piece(buckets: Any, data: list[dict[str, Tensor]]) -> Callable[[], None]:
    """One window per call, through the windows in turn, on a fresh model."""
    runner, cycle = runner_for(TinyLM(), buckets), itertools.cycle(data)

    def piece() -> None:
        runner(next(cycle))

    return piece


def profile(buckets: Any, data: list[dict[str, Tensor]]) -> dict[str, float]:
    """Padding fraction, micro-steps per window and distinct shapes of a setting."""
    runner, steps = runner_for(TinyLM(), buckets), []
    runner.optimizer.register_update_hook(lambda opt, report: steps.append(report.micro_steps))
    for batch in data:
        runner(batch)
    if runner.tally is None:  # the row cap: every micro-batch as long as its window
        real = sum(int(b["lengths"].sum()) for b in data)
        computed = sum(b["ids"].numel() for b in data)
        shapes = len({(ROW_CAP, b["ids"].shape[1]) for b in data})
    else:
        real, computed = runner.tally.tokens, runner.tally.computed
        shapes = len(runner.tally.shapes)
    return {
        "padding": 1 - real / computed,
        "micro_steps": statistics.mean(steps),
        "shapes": shapes,
    }


@pytest.mark.parametrize("name", [n for n in SETTINGS if n != ROW_CAP_NAME])
def test_token_budget(name: str, interleave: Interleave) -> None:
    data = windows()
    figures = {setting: profile(SETTINGS[setting], data) for setting in (ROW_CAP_NAME, name)}
    interleave(
        table=TABLE,
        contender_name=name,
        baseline_name=ROW_CAP_NAME,
        model="2-layer causal transformer, width 64",
        k=None,
        baseline=lambda: window_piece(False, data),
        contender=lambda n: window_piece(SETTINGS[name], data),
        rounds=ROUNDS,
        warmup=WARMUP,
        target=None,
        extra={
            "description": f"{ROWS} sequences per window, log-normal lengths cut at {MAX_LEN}",
            **{f"{key} ({s})": value for s, f in figures.items() for key, value in f.items()},
        },
    )

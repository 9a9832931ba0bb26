"""Micro-batches cut by a token budget, on the long-tailed paragraphs of CPython's docs.

The text is ``pydoc_data.topics`` (shipped with Python, no download), one sequence per
paragraph, cut at 256 characters: half the paragraphs have fewer than about 115 characters and
more than one in five is cut, so a batch padded to its longest row is mostly padding. Each
update takes 64 sequences (``--rows``) and averages the loss over their predicted characters.

1. Exactness, in float64: one window through ``MicroBatchRunner(..., budget=TokenBudget(...,
   rows_per_update=64))`` (micro-batches of at most ``--budget`` padded tokens, longest rows
   first, each cut to its own padded length) against one backward pass over the whole window
   padded into one batch: the parameters after the update agree to rounding.
2. The same training three times, in float32: a row cap (the 64 rows padded to the longest,
   cut into micro-batches of ``--row-cap`` rows, ``Accumulate(every=64 // row_cap)`` weighting
   each by its tokens), the token budget (padded lengths and row counts rounded to powers of
   two: few shapes) and the token budget cutting each micro-batch to its exact shape. The
   script prints each one's padding fraction, micro-steps per window, distinct micro-batch
   shapes and time per window, and the loss they reach: the same updates, so the same loss up
   to float32 rounding.

Run from the repository root::

    python examples/token_budget.py
    python examples/token_budget.py --windows 20 --budget 4096

Run time: about 10 s on 2 CPU cores shared with other jobs (``--threads 1``, the default).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pydoc_data.topics import topics
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner, TokenBudget

IGNORE = -100  # label of a padded position


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=8, help="updates to train per setting")
    parser.add_argument("--rows", type=int, default=64, help="sequences per update")
    parser.add_argument("--row-cap", type=int, default=8, help="rows per micro-batch (row cap)")
    parser.add_argument("--budget", type=int, default=2048, help="padded tokens per micro-batch")
    parser.add_argument("--max-len", type=int, default=256, help="longest sequence (characters)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and shuffling")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if min(args.windows, args.rows, args.row_cap, args.budget, args.max_len, args.threads) < 1:
        parser.error(
            "expected positive --windows, --rows, --row-cap, --budget, --max-len, --threads"
        )
    if args.rows % args.row_cap:
        parser.error("expected --rows to be a multiple of --row-cap")
    return args


def paragraphs(max_len: int, seed: int) -> tuple[int, list[Tensor]]:
    """The vocabulary size and one id sequence per paragraph (at most ``max_len + 1`` ids:
    inputs and next-character targets), shuffled."""
    text = "\n\n".join(topics.values())
    ids = {c: i + 1 for i, c in enumerate(sorted(set(text)))}  # 0 pads
    seqs = [
        torch.tensor([ids[c] for c in p[: max_len + 1]]) for p in text.split("\n\n") if len(p) > 1
    ]
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed))
    return len(ids) + 1, [seqs[i] for i in order]


def padded(seqs: list[Tensor]) -> dict[str, Tensor]:
    """Inputs, targets (``IGNORE`` where padded) and lengths, padded to the longest row."""
    width = max(len(s) for s in seqs) - 1
    inputs = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), IGNORE)
    for row, s in enumerate(seqs):
        inputs[row, : len(s) - 1], targets[row, : len(s) - 1] = s[:-1], s[1:]
    return {
        "inputs": inputs,
        "targets": targets,
        "lengths": torch.tensor([len(s) - 1 for s in seqs]),
    }


class CausalLM(nn.Module):
    """One causal self-attention block over character embeddings, then a linear head. Right
    padding changes no real position's output: each attends only to those before it."""

    def __init__(self, vocab: int, max_len: int, width: int = 128) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(max_len, width)
        self.block = nn.TransformerEncoderLayer(
            width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, inputs: Tensor) -> Tensor:
        n = inputs.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=self.head.weight.dtype)
        h = self.embed(inputs) + self.pos(torch.arange(n))
        return self.head(self.block(h, src_mask=mask, is_causal=True))


def summed_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(batch["inputs"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="sum")


def predicted(batch: dict[str, Tensor]) -> Tensor:
    """Each row's loss-bearing positions (host counts: no sync)."""
    return (batch["targets"] != IGNORE).sum(1)


def budget_runner(
    model: nn.Module, opt: Accumulate, args: argparse.Namespace, buckets: str | None = "pow2"
) -> MicroBatchRunner:
    spec = TokenBudget(
        args.budget,
        cost=lambda batch: batch["lengths"],
        items=predicted,
        padded=True,
        sort=True,
        rows_per_update=args.rows,
        buckets=buckets,  # type: ignore[arg-type]
    )
    return MicroBatchRunner(
        opt, lambda b: summed_loss(model, b), budget=spec, loss_reduction="sum", model=model
    )


def exact_window(model: nn.Module, window: dict[str, Tensor], args: argparse.Namespace) -> float:
    """The largest parameter difference, in float64, between one update of the budget runner
    and one full-batch step on the window's token mean."""
    ours, ref = copy.deepcopy(model).double(), copy.deepcopy(model).double()
    opt = Accumulate(torch.optim.SGD(ours.parameters(), lr=0.5), every_items=math.inf)
    budget_runner(ours, opt, args)(window)
    assert opt.updates == 1
    (summed_loss(ref, window) / predicted(window).sum()).backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    return max((p - q).abs().max().item() for p, q in zip(ours.parameters(), ref.parameters()))


def train(
    model: nn.Module, windows: list[dict[str, Tensor]], args: argparse.Namespace, buckets: Any
) -> dict[str, Any]:
    """Train on ``windows`` with the row cap (``buckets`` False) or the token budget and its
    ``buckets``; what it cost."""
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if buckets is not False:
        opt = Accumulate(inner, every_items=math.inf, model=model)
        runner = budget_runner(model, opt, args, buckets)
    else:

        def loss_fn(b: dict[str, Tensor]) -> tuple[Tensor, int]:
            return summed_loss(model, b), int(predicted(b).sum())

        opt = Accumulate(inner, every=args.rows // args.row_cap, model=model)
        runner = MicroBatchRunner(
            opt, loss_fn, micro_batch_size=args.row_cap, loss_reduction="sum", model=model
        )
    steps: list[int] = []
    opt.register_update_hook(lambda o, report: steps.append(report.micro_steps))
    seconds, losses = [], []
    for window in windows:
        start = time.perf_counter()
        losses.append(float(runner(window)))
        seconds.append(time.perf_counter() - start)
    real = sum(int(w["lengths"].sum()) for w in windows)
    computed = sum(w["inputs"].numel() for w in windows)  # each window padded to its longest
    if runner.tally is not None:
        real, computed = runner.tally.tokens, runner.tally.computed
    return {
        "padding": 1 - real / computed,
        "micro_steps": statistics.mean(steps),
        "seconds": statistics.median(seconds),
        "loss": statistics.mean(losses[-3:]) / math.log(2),
        "shapes": None if runner.tally is None else len(runner.tally.shapes),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    vocab, seqs = paragraphs(args.max_len, args.seed)
    lengths = sorted(len(s) - 1 for s in seqs)
    quantile = [lengths[int(q * (len(lengths) - 1))] for q in (0.5, 0.9, 1.0)]
    print(
        f"{len(seqs)} paragraphs, characters per paragraph: median {quantile[0]}, "
        f"90th percentile {quantile[1]}, longest {quantile[2]} (cut at {args.max_len})"
    )
    windows = [
        padded(seqs[w * args.rows : (w + 1) * args.rows])
        for w in range(min(args.windows, len(seqs) // args.rows))
    ]
    model = CausalLM(vocab, args.max_len)
    diff = exact_window(model, windows[0], args)
    print(
        f"one window of {args.rows} sequences, float64: largest parameter difference from "
        f"the full-batch token mean {diff:.1e}"
    )
    settings = {"row cap": False, "token budget": "pow2", "exact shapes": None}
    results = {name: train(copy.deepcopy(model), windows, args, b) for name, b in settings.items()}
    print(
        f"{'':>13} {'per micro-batch':>15} {'padding':>8} {'micro-steps':>11} {'shapes':>6} "
        f"{'s/window':>8} {'bits/char':>9}"
    )
    for name, r in results.items():
        size = f"{args.row_cap} rows" if name == "row cap" else f"{args.budget} tokens"
        shapes = "-" if r["shapes"] is None else r["shapes"]
        print(
            f"{name:>13} {size:>15} {r['padding']:>8.1%} {r['micro_steps']:>11.1f} "
            f"{shapes:>6} {r['seconds']:>8.3f} {r['loss']:>9.3f}"
        )
    return {"max_abs_diff": diff, **results}


if __name__ == "__main__":
    main()

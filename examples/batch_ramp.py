"""Batch-size ramp-up and an adaptive batch, with the gradient noise scale measured online.

The char-level transformer and text of ``char_lm.py`` (CPython's own docs, no download),
trained twice on the same token budget with ``opt.backward(loss_sum, items=n_tokens)``:

(a) **ramp-up**: ``every_items=LinearRamp(512, 4096, over_items=...)``: the effective batch grows
    from 512 to 4096 tokens over the first half of the run, in steps of 512 (Megatron's
    ``--rampup-batch-size``), then stays;
(b) **adaptive**: ``every_items=AdaptiveBatch(512, 8192)``: the batch grows toward the measured
    gradient noise scale ``B_simple`` (McCandlish et al. 2018), at most x1.5 per change, never
    shrinking.

The micro-batches are the same in both (8 length-bucketed sequences): only the number of
micro-batches per update changes. Both runs measure ``opt.noise_scale`` in every window
(``NoiseScale(every_windows=1)``: its default measures one window per 16 micro-steps, which
would leave the first, short windows of these runs with few estimates; every window costs a
few % on this small CPU model). The script prints a few rows per run and writes a PNG
(matplotlib, optional) with the noise-scale estimate, the effective batch and the training
loss against tokens seen.

Run from the repository root::

    python examples/batch_ramp.py                  # writes batch_ramp.png
    python examples/batch_ramp.py --tokens 1000000 --out ramp.png

Run time (measured): 25 s wall on 2 CPU cores shared with other jobs, ``--threads 1`` (the
default), 500k tokens per run; matplotlib adds about 2 s.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from char_lm import CharTransformer, collate, load_chunks, loss_sum, micro_batches

from accumopt import Accumulate
from accumopt.noise import NoiseScale
from accumopt.schedules import AdaptiveBatch, LinearRamp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=500_000, help="target tokens per run")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and batching")
    parser.add_argument("--max-len", type=int, default=64, help="longest sequence (chars)")
    parser.add_argument("--out", default="batch_ramp.png", help="the PNG to write ('' for none)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if min(args.tokens, args.batch_size, args.threads) < 1:
        parser.error("expected --tokens, --batch-size, --threads >= 1")
    return args


def train(args: argparse.Namespace, policy: str) -> dict[str, list[float]]:
    """One run; per update: tokens seen, effective batch, noise scale, loss (bits/char)."""
    torch.manual_seed(args.seed)
    vocab, chunks = load_chunks(8, args.max_len)
    model = CharTransformer(len(vocab), args.max_len)
    if policy == "ramp-up":
        every_items: Any = LinearRamp(512, 4096, over_items=args.tokens / 2, increment=512)
    else:
        every_items = AdaptiveBatch(512, 8192, growth=1.5, warmup=10)
    opt = Accumulate(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        every_items=every_items,
        max_grad_norm=1.0,
        noise_scale=NoiseScale(every_windows=1),  # an estimate per window, for the plot
    )
    stream = micro_batches(chunks, args.batch_size, torch.Generator().manual_seed(args.seed))
    log: dict[str, list[float]] = {"tokens": [], "batch": [], "noise": [], "loss": []}
    seen, nats, window_tokens = 0, 0.0, 0
    while seen < args.tokens:
        loss, n = loss_sum(model, *collate(next(stream)))
        opt.backward(loss, items=n)
        batch = opt.items  # the window's tokens so far (the update's batch at the boundary)
        opt.step()
        opt.zero_grad()
        seen, nats, window_tokens = seen + n, nats + loss.item(), window_tokens + n
        if opt.did_update:
            assert opt.noise_scale is not None
            value = opt.noise_scale.value
            log["tokens"].append(seen)
            log["batch"].append(batch)
            log["noise"].append(math.nan if value is None else value)
            log["loss"].append(nats / window_tokens / math.log(2))
            nats, window_tokens = 0.0, 0
    return log


def plot(runs: dict[str, dict[str, list[float]]], out: str) -> bool:
    """Write the three panels; False (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "note: matplotlib is not installed, so no PNG was written "
            "(pip install matplotlib); the numbers above are the whole result."
        )
        return False
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for name, log in runs.items():
        tokens = [t / 1e3 for t in log["tokens"]]
        axes[0].plot(tokens, log["noise"], label=name)
        axes[1].step(tokens, log["batch"], where="post", label=name)
        axes[2].plot(tokens, log["loss"], label=name, alpha=0.8)
    axes[0].set_ylabel("noise scale B_simple\n(tokens, EMA)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("effective batch\n(tokens per update)")
    axes[2].set_ylabel("training loss\n(bits/char)")
    axes[2].set_xlabel("tokens seen (thousands)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("accumopt: batch ramp-up vs adaptive batch, char-level LM")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out}")
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    runs = {policy: train(args, policy) for policy in ("ramp-up", "adaptive")}
    for name, log in runs.items():
        print(f"{name}: {len(log['tokens'])} updates")
        for i in sorted({0, len(log["tokens"]) // 2, len(log["tokens"]) - 1}):
            print(
                f"  {log['tokens'][i]:>8.0f} tokens: batch {log['batch'][i]:>5.0f}, noise "
                f"scale {log['noise'][i]:>8.0f}, loss {log['loss'][i]:.3f} bits/char"
            )
    wrote = bool(args.out) and plot(runs, args.out)
    print(f"run time: {time.perf_counter() - start:.1f} s")
    return {"runs": runs, "png": args.out if wrote else None}


if __name__ == "__main__":
    main()

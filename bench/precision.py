"""Accuracy of bf16 gradient accumulation: float32 window buffer vs plain bf16 ``.grad`` sums.

For a small bf16 MLP and windows of k micro-batches (8 samples each), the relative error
``||g - g_ref|| / ||g_ref||`` of the gradient handed to the inner optimizer is compared with
the *floor*: the median error of a single bf16 micro-batch gradient against its own float64
value. ``g_ref`` is the float64 gradient of the same (bf16-representable) weights and inputs,
so only arithmetic rounding is measured.

Also times one window of 64 bf16 micro-steps with the buffer off (twice: an A/A pair), on,
and on with ``nonfinite="skip_window"``, each configuration on its own copy of the model,
in interleaved rounds (all four once per round, in a fresh random order; garbage collection
off; thread CPU clock): medians of the per-round ratios to "buffer off".

Run: ``python bench/precision.py [--seeds 5] [--ks 16 256 1024] [--rounds 15] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import statistics
from collections.abc import Callable
from typing import Any

import torch
from _common import add_json_option, markdown_table, quartiles, write_json
from _interleave import timed
from torch import nn

from accumopt import Accumulate

MICRO = 8


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])  # type: ignore[union-attr]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum() / MICRO


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def gradient_errors(k: int, buffer: bool | None, seed: int = 0) -> tuple[float, float]:
    """(error of the window gradient, median error of one micro-batch gradient)."""
    torch.manual_seed(seed)
    model16 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(torch.bfloat16)
    model64 = copy.deepcopy(model16).double()
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(k, MICRO, 16, generator=g, dtype=torch.float64).bfloat16().double()
    ys = torch.randn(k, MICRO, 1, generator=g, dtype=torch.float64).bfloat16().double()
    (sum(_loss(model64, x, y) for x, y in zip(xs, ys)) / k).backward()
    ref = _flat_grad(model64)
    acc = Accumulate(torch.optim.SGD(model16.parameters(), lr=0.0), every=k, buffer=buffer)
    window = ref
    for x, y in zip(xs, ys):
        _loss(model16, x.bfloat16(), y.bfloat16()).backward()
        if acc.will_update:
            window = _flat_grad(model16)
        acc.step()
    del acc  # stop counting: the single micro-batches below are plain autograd
    singles = []
    for x, y in list(zip(xs, ys))[:16]:
        model64.zero_grad()
        model16.zero_grad()
        _loss(model64, x, y).backward()
        _loss(model16, x.bfloat16(), y.bfloat16()).backward()
        singles.append(_rel(_flat_grad(model16), _flat_grad(model64)))
    return _rel(window, ref), statistics.median(singles)


#: timed configurations: name -> ``Accumulate`` options ("buffer off" twice: the A/A pair)
CONFIGS: dict[str, dict[str, Any]] = {
    "buffer off": {"buffer": False},
    "buffer off (A/A)": {"buffer": False},
    "buffer on": {"buffer": True},
    "buffer on, skip_window": {"buffer": True, "nonfinite": "skip_window"},
}


def window_times(k: int = 64, rounds: int = 15, warmup: int = 2) -> dict[str, dict[str, float]]:
    """One window of k bf16 micro-steps per configuration of :data:`CONFIGS`, each on its own
    copy of the model, in interleaved rounds (a fresh random order every round, garbage
    collection off), timed on the thread CPU clock. Per configuration: the median ms per window
    and the quartiles of its per-round ratio to "buffer off"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 10)).to(torch.bfloat16)
    x, y = torch.randn(32, 256).bfloat16(), torch.randn(32, 10).bfloat16()

    def window_of(options: dict[str, Any]) -> Callable[[], None]:
        net = copy.deepcopy(model)
        acc = Accumulate(torch.optim.SGD(net.parameters(), lr=0.0), every=k, **options)

        def window() -> None:
            for _ in range(k):
                ((net(x) - y) ** 2).mean().backward()
                acc.step()
                acc.zero_grad()

        return window

    windows = {name: window_of(options) for name, options in CONFIGS.items()}
    rng = random.Random(0)
    times: dict[str, list[int]] = {name: [] for name in windows}
    gc.collect()
    gc.disable()
    try:
        for r in range(warmup + rounds):
            order = list(windows)
            rng.shuffle(order)
            got = {name: timed(windows[name])[0] for name in order}
            if r >= warmup:
                for name, ns in got.items():
                    times[name].append(ns)
    finally:
        gc.enable()
    base = times["buffer off"]
    out = {}
    for name, ns in times.items():
        q1, ratio, q3 = quartiles([t / b for t, b in zip(ns, base)])
        out[name] = {"ms": quartiles(ns)[1] / 1e6, "ratio": ratio, "q1": q1, "q3": q3}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    add_json_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table: dict[int, dict[str, float]] = {}
    rows = []
    for k in args.ks:
        runs = [
            (gradient_errors(k, None, s), gradient_errors(k, False, s)[0])
            for s in range(args.seeds)
        ]
        floor = statistics.median(r[0][1] for r in runs)
        buffered = statistics.median(r[0][0] for r in runs)
        plain = statistics.median(r[1] for r in runs)
        table[k] = {"floor": floor, "buffer": buffered, "plain": plain}
        rows.append(
            [
                str(k),
                f"{floor:.2e}",
                f"{buffered:.2e}",
                f"{buffered / floor:.2f}",
                f"{plain:.2e}",
                f"{plain / floor:.2f}",
            ]
        )
    header = [
        "k micro-steps",
        "floor (one micro-batch)",
        "fp32 buffer",
        "/ floor",
        "bf16 .grad",
        "/ floor",
    ]
    timing = window_times(rounds=args.rounds)
    timing_rows = [
        [name, f"{t['ms']:.2f}", f"{t['ratio']:.3f} ({t['q1']:.3f}-{t['q3']:.3f})"]
        for name, t in timing.items()
    ]
    markdown = (
        f"bf16 MLP 16-32-1, micro-batches of {MICRO} samples, median over {args.seeds} seeds.\n\n"
        + markdown_table(header, rows)
        + "\n\nOne window of k = 64 bf16 micro-steps (MLP 256-512-10, micro-batch 32, 1 thread), "
        f"each configuration on its own copy of the model, in {args.rounds} interleaved rounds "
        "(random order each round); thread CPU clock, medians, ratios per round to buffer off "
        "(interquartile range in brackets; the A/A row is a second buffer-off copy). "
        "`skip_window` adds one check and host sync per window; with nonfinite=None "
        "no check runs.\n\n"
        + markdown_table(["configuration", "ms per window", "ratio to buffer off"], timing_rows)
    )
    print(markdown)
    data = {"table": table, "timing": timing, "rounds": args.rounds, "markdown": markdown}
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()

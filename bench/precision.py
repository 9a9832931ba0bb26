"""Accuracy of bf16 gradient accumulation: float32 window buffer vs plain bf16 ``.grad`` sums.

For a small bf16 MLP and windows of k micro-batches (8 samples each), the relative error
``||g - g_ref|| / ||g_ref||`` of the gradient handed to the inner optimizer is compared with
the *floor*: the median error of a single bf16 micro-batch gradient against its own float64
value. ``g_ref`` is the float64 gradient of the same (bf16-representable) weights and inputs,
so only arithmetic rounding is measured. Also times a window with the buffer on and off.

Run: ``python bench/precision.py [--seeds 5] [--ks 16 256 1024] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from _common import add_json_option, markdown_table, write_json
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


def window_time(k: int = 64, repeats: int = 15, **options: Any) -> float:
    """Median seconds for one window of k bf16 micro-steps with the given ``Accumulate``
    options (``buffer=``, ``nonfinite=``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 10)).to(torch.bfloat16)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.0), every=k, **options)
    x, y = torch.randn(32, 256).bfloat16(), torch.randn(32, 10).bfloat16()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(k):
            ((model(x) - y) ** 2).mean().backward()
            acc.step()
            acc.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 256, 1024])
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
    off, on = window_time(buffer=False), window_time(buffer=True)
    checked = window_time(nonfinite="skip_micro_batch")
    markdown = (
        f"bf16 MLP 16-32-1, micro-batches of {MICRO} samples, median over {args.seeds} seeds.\n\n"
        + markdown_table(header, rows)
        + f"\n\nOne window of 64 bf16 micro-steps (MLP 256-512-10, micro-batch 32, 1 thread): "
        f"buffer off {1e3 * off:.2f} ms; buffer on {1e3 * on:.2f} ms ({on / off:.3f}x); buffer "
        f"on and nonfinite='skip_micro_batch' (a check and a host sync per micro-step) "
        f"{1e3 * checked:.2f} ms ({checked / off:.3f}x). With nonfinite=None no check runs."
    )
    print(markdown)
    data = {
        "table": table,
        "buffer_on_s": on,
        "buffer_off_s": off,
        "checked_s": checked,
        "markdown": markdown,
    }
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()

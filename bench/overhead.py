"""Per-update overhead of ``Accumulate`` against a hand-written accumulation loop.

Both loops train the same model on the same micro-batches: the hand loop does
``(loss / k).backward()`` and steps/zeroes every k micro-batches; accumopt does
``loss.backward(); opt.step(); opt.zero_grad()`` on every micro-batch. One *sample* times one
window (k micro-steps and the update) of each loop; the two are interleaved (ABAB...) so that
machine noise hits both alike, and the reported figure is the median of the per-pair ratios.

Run: ``python bench/overhead.py [--repeats 31] [--k 8] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from accumopt import Accumulate


def models() -> dict[str, tuple[nn.Module, int, int]]:
    """name -> (model, input width, micro-batch size)."""
    torch.manual_seed(0)
    many = [nn.Linear(16, 16) for _ in range(50)]  # 100 parameter tensors
    return {
        "tiny MLP (framework overhead dominates)": (
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
            32,
            32,
        ),
        "100 parameter tensors": (nn.Sequential(*many), 16, 32),
        "compute-heavy MLP": (
            nn.Sequential(
                nn.Linear(512, 2048),
                nn.ReLU(),
                nn.Linear(2048, 2048),
                nn.ReLU(),
                nn.Linear(2048, 10),
            ),
            512,
            64,
        ),
    }


def hand_loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list, k: int) -> None:
    for x, y in batches:
        (F.mse_loss(model(x), y) / k).backward()
    opt.step()
    opt.zero_grad()


def accumopt_loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list, k: int) -> None:
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, spec: tuple[nn.Module, int, int], k: int, repeats: int) -> dict[str, float]:
    model, width, micro = spec
    out = model(torch.zeros(1, width)).shape[-1]
    batches = [(torch.randn(micro, width), torch.randn(micro, out)) for _ in range(k)]
    twin = copy.deepcopy(model)  # the wrapper counts every backward through its parameters
    hand_opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    acc = Accumulate(torch.optim.SGD(twin.parameters(), lr=1e-4), every=k)
    hand = lambda: hand_loop(model, hand_opt, batches, k)  # noqa: E731
    ours = lambda: accumopt_loop(twin, acc, batches, k)  # noqa: E731
    for _ in range(3):  # warm-up
        hand()
        ours()
    ratios, hand_times, our_times = [], [], []
    for i in range(repeats):
        if i % 2:
            t_ours, t_hand = timed(ours), timed(hand)
        else:
            t_hand, t_ours = timed(hand), timed(ours)
        ratios.append(t_ours / t_hand)
        hand_times.append(t_hand)
        our_times.append(t_ours)
    return {
        "ratio": statistics.median(ratios),
        "hand_ms": 1e3 * statistics.median(hand_times),
        "accumopt_ms": 1e3 * statistics.median(our_times),
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--k", type=int, default=8, help="micro-steps per update")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), k={args.k}, "
        f"median of {args.repeats} interleaved repeats"
    )
    print(f"{'model':42s} {'hand loop ms':>13s} {'accumopt ms':>12s} {'ratio':>7s}")
    results = {}
    for name, spec in models().items():
        r = measure(name, spec, args.k, args.repeats)
        results[name] = r
        print(f"{name:42s} {r['hand_ms']:13.3f} {r['accumopt_ms']:12.3f} {r['ratio']:7.3f}")
    return results


if __name__ == "__main__":
    main()

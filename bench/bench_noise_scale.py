"""The cost of the online gradient noise scale (``Accumulate(..., noise_scale=True)``).

``Accumulate(SGD, every=k, noise_scale=True)`` against the same loop without the estimate
(``loss.backward(); opt.step(); opt.zero_grad()`` per micro-batch, both accumopt), interleaved
with a second copy of the loop without it (the A/A ratio), on the "100 tensors" and the
"compute-heavy MLP" workloads of ``_loops.py`` at k = 4 and 8. The estimate adds two
squared-norm passes over the gradients per measured window (first micro-step, boundary;
``accumopt.noise.SquaredNorm``: on a CPU, small gradients stacked by shape and dotted, 0.1-0.2
ms per measured window for the 100 tensors inside the loop; large ones one norm per tensor) and
a few small tensor ops at the boundary: its per-micro-step cost is the ratio, per window of k.
The 100-tensor model runs with the default (``every_windows=None``: one window per 16
micro-steps measured, one in 4 at k = 4, one in 2 at k = 8) and with every window measured
(``every_windows=1``); the compute-heavy MLP with every window measured.

Target (the noise-scale issue): 1.01 per micro-step.

Run as a benchmark (``pytest bench/bench_noise_scale.py --benchmark-only``) or alone:
``python bench/bench_noise_scale.py [--rounds N]`` (default: 41, 21 on the compute-heavy MLP)
prints the median thread-CPU ratio, its interquartile range and the A/A spread per case.
"""

from __future__ import annotations

import argparse
import copy
import math
from typing import Any

import pytest
import torch
from _interleave import Rounds, summarize
from _loops import accumopt_window, workload

from accumopt.noise import NoiseScale

TABLE = "noise scale"
TARGET = 1.01
#: counted rounds per model: a compute-heavy round takes about a second on 2 slow cores, and its
#: A/A spread (0.03-0.08) is wide at any count; 21 rounds keep the whole suite under 10 minutes
ROUNDS = {"100 tensors": 41, "compute-heavy MLP": 21}
WARMUP = 2
# (workload, k, every_windows): None is NoiseScale's default (one window per 16 micro-steps)
CASES: list[tuple[str, int, int | None]] = [
    ("100 tensors", 4, None),
    ("100 tensors", 8, None),
    ("100 tensors", 4, 1),
    ("100 tensors", 8, 1),
    ("compute-heavy MLP", 4, 1),
    ("compute-heavy MLP", 8, 1),
]
OFF = 0  # every_windows value standing for the loop without the estimate
SLOW_ON_CPU = pytest.mark.xfail(
    strict=False,
    reason="every window measured on a CPU model of 100 small tensors: the two squared-norm "
    "passes inside the loop (0.1-0.2 ms per measured window: the .grad reads and one stack "
    "per shape, on caches the backward left cold) are 1.5-3.5 % of a 6.5-13 ms window "
    "(medians 1.015-1.036 over the runs of 2026-12-01); the default, one window per 16 "
    "micro-steps, stays at the target",
)
CONTENDER = "accumopt, noise_scale=True"
BASELINE = "accumopt"


def noise_window(model: torch.nn.Module, batches: list[Any], every_windows: int | None) -> Any:
    """One window of ``Accumulate(SGD, every=k)``, with the estimate measuring one window in
    ``every_windows`` (None: NoiseScale's default; OFF: without the estimate)."""
    estimate = False if every_windows == OFF else NoiseScale(every_windows=every_windows)
    return accumopt_window(model, batches, noise_scale=estimate)


def _setting(every_windows: int | None) -> str:
    """How a case's contender is named in the tables."""
    if every_windows is None:
        return f"default (one window per {NoiseScale.MIN_MICRO_STEPS} micro-steps)"
    return f"every_windows={every_windows}"


PARAMS = [
    pytest.param(n, k, e, marks=[SLOW_ON_CPU] if (n, e) == ("100 tensors", 1) else [])
    for n, k, e in CASES
]


@pytest.mark.parametrize(
    ("name", "k", "every_windows"), PARAMS, ids=[f"{n}-k{k}-every{e}" for n, k, e in CASES]
)
def test_noise_scale(name: str, k: int, every_windows: int | None, interleave: Any) -> None:
    work = workload(name, k)
    interleave(
        table=TABLE,
        contender_name=f"{CONTENDER}, {_setting(every_windows)}",
        baseline_name=BASELINE,
        model=work.name,
        k=k,
        baseline=lambda: noise_window(copy.deepcopy(work.model), work.batches, OFF),
        contender=lambda n: noise_window(copy.deepcopy(work.model), work.batches, every_windows),
        rounds=ROUNDS[name],
        warmup=WARMUP,
        target=TARGET,
        extra={"description": work.description},
        # the default measures one window in a cycle of ceil(16 / k): whole cycles per piece
        repeat_multiple=math.ceil(NoiseScale.MIN_MICRO_STEPS / k) if every_windows is None else 1,
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: ROUNDS)")
    parser.add_argument("--repeat", type=int, default=20, help="windows per timed piece")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    for name, k, every_windows in CASES:
        work = workload(name, k)
        pieces = [
            noise_window(copy.deepcopy(work.model), work.batches, e)
            for e in (OFF, every_windows, OFF)
        ]

        def repeated(window: Any) -> Any:
            return lambda: [window() for _ in range(args.repeat)] and None

        rounds = Rounds(*(repeated(p) for p in pieces))
        rounds.counting = False
        for _ in range(WARMUP):
            rounds.play()
        rounds.counting = True
        for _ in range(args.rounds or ROUNDS[name]):
            rounds.play()
        result = summarize(rounds, TARGET)
        cpu = result["cpu"]
        print(
            f"{name:18s} k={k} {_setting(every_windows)}: on/off {cpu['median']:.4f} "
            f"(IQR {cpu['q1']:.4f}-{cpu['q3']:.4f}), A/A {cpu['aa_median']:.4f} "
            f"(spread {result['aa_spread']:.4f}), off {cpu['baseline_ms']:.2f} ms per "
            f"{args.repeat} windows: {result['verdict']}"
        )
        out.append(
            {
                "model": name,
                "k": k,
                "every_windows": every_windows,
                **{key: result[key] for key in ("aa_spread", "verdict")},
                "cpu_median": cpu["median"],
            }
        )
    return out


if __name__ == "__main__":
    main()

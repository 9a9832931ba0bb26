"""The cost of the online gradient noise scale (``Accumulate(..., noise_scale=True)``).

``Accumulate(SGD, every=k, noise_scale=True)`` against the same loop without the estimate
(``loss.backward(); opt.step(); opt.zero_grad()`` per micro-batch, both accumopt), interleaved
with a second copy of the loop without it (the A/A ratio), on the "100 tensors" and the
"compute-heavy MLP" workloads of ``_loops.py`` at k = 4 and 8. The estimate adds two
``torch._foreach_norm`` over the gradients per window (first micro-step, boundary) and a few
small tensor ops at the boundary: its per-micro-step cost is the ratio, per window of k.

Target (the noise-scale issue): 1.01 per micro-step.

Run as a benchmark (``pytest bench/bench_noise_scale.py --benchmark-only``) or alone:
``python bench/bench_noise_scale.py [--rounds 41]`` prints the median thread-CPU ratio, its
interquartile range and the A/A spread per case.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest
import torch
from _interleave import Rounds, summarize
from _loops import loss_of, workload

from accumopt import Accumulate

TABLE = "noise scale"
TARGET = 1.01
ROUNDS = 41
WARMUP = 2
CASES = [("100 tensors", 4), ("100 tensors", 8), ("compute-heavy MLP", 4), ("compute-heavy MLP", 8)]
CONTENDER = "accumopt, noise_scale=True"
BASELINE = "accumopt"


def noise_window(model: torch.nn.Module, batches: list[Any], on: bool) -> Any:
    """One window of ``Accumulate(SGD, every=k)``, with or without the estimate."""
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=1e-4), every=len(batches), noise_scale=on
    )

    def window() -> None:
        for x, y in batches:
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()

    return window


@pytest.mark.parametrize(("name", "k"), CASES, ids=[f"{n}-k{k}" for n, k in CASES])
def test_noise_scale(name: str, k: int, interleave: Any) -> None:
    work = workload(name, k)
    interleave(
        table=TABLE,
        contender_name=CONTENDER,
        baseline_name=BASELINE,
        model=work.name,
        k=k,
        baseline=lambda: noise_window(copy.deepcopy(work.model), work.batches, False),
        contender=lambda n: noise_window(copy.deepcopy(work.model), work.batches, True),
        rounds=ROUNDS,
        warmup=WARMUP,
        target=TARGET,
        extra={"description": work.description},
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--repeat", type=int, default=20, help="windows per timed piece")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    for name, k in CASES:
        work = workload(name, k)
        pieces = [
            noise_window(copy.deepcopy(work.model), work.batches, on) for on in (False, True, False)
        ]

        def repeated(window: Any) -> Any:
            return lambda: [window() for _ in range(args.repeat)] and None

        rounds = Rounds(*(repeated(p) for p in pieces))
        rounds.counting = False
        for _ in range(WARMUP):
            rounds.play()
        rounds.counting = True
        for _ in range(args.rounds):
            rounds.play()
        result = summarize(rounds, TARGET)
        cpu = result["cpu"]
        print(
            f"{name:18s} k={k}: noise_scale on/off {cpu['median']:.4f} "
            f"(IQR {cpu['q1']:.4f}-{cpu['q3']:.4f}), A/A {cpu['aa_median']:.4f} "
            f"(spread {result['aa_spread']:.4f}), off {cpu['baseline_ms']:.2f} ms per "
            f"{args.repeat} windows: {result['verdict']}"
        )
        out.append(
            {
                "model": name,
                "k": k,
                **{key: result[key] for key in ("aa_spread", "verdict")},
                "cpu_median": cpu["median"],
            }
        )
    return out


if __name__ == "__main__":
    main()

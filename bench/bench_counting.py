"""Default counting (at the parameters) on models of many parameter tensors, k = 1 to 4.

``Accumulate(SGD, every=k)`` with ``loss.backward(); opt.step(); opt.zero_grad()`` per
micro-batch against the hand loop (``(loss / k).backward()``, plain ``loss.backward()`` at
k = 1), interleaved with a second copy of the hand loop, on ``N / 2`` x ``Linear(16, 16)``
(N = 100, 200, 400 parameter tensors, micro-batch 32). With few micro-steps per window the
hand loop's ``loss / k`` saves little, so what the counting costs per parameter tensor shows.

Target (issue 14): 1.03 everywhere.
"""

from __future__ import annotations

import copy

import pytest
from _harness import Interleave, cases
from _loops import ACCUMOPT, accumopt_window, hand_window, workload

TABLE = "counting"
TARGET = 1.03
ROUNDS = 41
WARMUP = 2
TENSORS = (100, 200, 400)
KS = (1, 2, 3, 4)
#: (tensors, k) pairs that miss the target on the current code: all of them (medians 1.07-1.12
#: in the last full run; 200 tensors at k = 1 passed only inside a wide A/A spread)
MISSING: set[tuple[int, int]] = {(tensors, k) for tensors in TENSORS for k in KS}


GRID = [(tensors, k) for tensors in TENSORS for k in KS]


@pytest.mark.parametrize(("tensors", "k"), cases(GRID, MISSING, [f"{t}t-k{k}" for t, k in GRID]))
def test_counting(tensors: int, k: int, interleave: Interleave) -> None:
    work = workload(f"{tensors} tensors", k)
    interleave(
        table=TABLE,
        contender_name=ACCUMOPT,
        model=work.name,
        k=k,
        baseline=lambda: hand_window(copy.deepcopy(work.model), work.batches),
        contender=lambda n: accumopt_window(copy.deepcopy(work.model), work.batches),
        rounds=ROUNDS,
        warmup=WARMUP,
        target=TARGET,
        extra={"description": work.description},
    )

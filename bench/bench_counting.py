"""Counting on models of many parameter tensors, k = 1 to 4, both ways.

``Accumulate(SGD, every=k)`` (counting at the parameters, the default without ``model=``) and
``Accumulate(SGD, every=k, model=model)`` (counting at the model's outputs, the documented way
for an ``nn.Module``) with ``loss.backward(); opt.step(); opt.zero_grad()`` per micro-batch
against the hand loop (``(loss / k).backward()``, plain ``loss.backward()`` at
k = 1), interleaved with a second copy of the hand loop, on ``N / 2`` x ``Linear(16, 16)``
(N = 100, 200, 400 parameter tensors, micro-batch 32). With few micro-steps per window the
hand loop's ``loss / k`` saves little, so what the counting costs per parameter tensor shows.

Target (issue 14): 1.03 everywhere.
"""

from __future__ import annotations

import copy

import pytest
from _harness import Interleave, cases
from _loops import ACCUMOPT, ACCUMOPT_MODEL, accumopt_window, hand_window, workload

TABLE = "counting"
TARGET = 1.03
ROUNDS = 41
WARMUP = 2
TENSORS = (100, 200, 400)
KS = (1, 2, 3, 4)
WAYS = {ACCUMOPT: False, ACCUMOPT_MODEL: True}  # contender -> model= given
#: (way, tensors, k) that miss the target on the current code: all of them, as the target
#: reads (run of 2026-12-07 15:20 UTC, a quiet machine: counting at the parameters, medians
#: 1.06-1.14; with model=, 1.01-1.10, at or under 1.03 in 3 of the 12 cells, all on 400 tensors)
MISSING: set[tuple[str, int, int]] = {(w, t, k) for w in WAYS for t in TENSORS for k in KS}


GRID = [(way, tensors, k) for way in WAYS for tensors in TENSORS for k in KS]
IDS = [f"{'model' if WAYS[w] else 'params'}-{t}t-k{k}" for w, t, k in GRID]


@pytest.mark.parametrize(("way", "tensors", "k"), cases(GRID, MISSING, IDS))
def test_counting(way: str, tensors: int, k: int, interleave: Interleave) -> None:
    work = workload(f"{tensors} tensors", k)
    given = WAYS[way]
    interleave(
        table=TABLE,
        contender_name=way,
        model=work.name,
        k=k,
        baseline=lambda: hand_window(copy.deepcopy(work.model), work.batches),
        contender=lambda n: accumopt_window(copy.deepcopy(work.model), work.batches, given=given),
        rounds=ROUNDS,
        warmup=WARMUP,
        target=TARGET,
        extra={"description": work.description},
    )

"""Time per optimizer step of accumopt and the peers against a hand-written accumulation loop.

One benchmark per (contender, model, k): interleaved rounds of the hand loop (twice, as two
copies A and B) and the contender, each training its own deep copy of the model on the same k
micro-batches per optimizer step with plain SGD (the loops: ``_loops.py``). The peer table is at
k = 8; accumopt's two ways of counting are measured at k = 1 too (one micro-step per step: the
hand loop is then plain ``loss.backward()``, so this is accumopt's cost on a loop that does not
accumulate at all).

Targets (issue 31): accumopt on the tiny MLP within 1.05x of the hand loop at k = 8 and 1.10x
at k = 1; on the 100-tensor and compute-heavy models within 1.03x; the peers are measured, not
judged. Rows that miss today are marked xfail with the reason.
"""

from __future__ import annotations

import copy

import pytest
from _harness import Interleave, need
from _loops import (
    ACCUMOPT,
    ACCUMOPT_MODEL,
    CONTENDERS,
    HEAVY,
    HUNDRED,
    TINY,
    contender_window,
    hand_window,
    workload,
)

TABLE = "overhead"
#: counted rounds per model (a round runs three windows; the compute-heavy one takes ~0.2 s)
ROUNDS = {TINY: 61, HUNDRED: 41, HEAVY: 11}
WARMUP = {TINY: 3, HUNDRED: 3, HEAVY: 1}
TARGETS = {(TINY, 8): 1.05, (TINY, 1): 1.10}  # issue 31; 1.03 on every other (model, k)
CLAIM = "issue 31's target, not met by this way of counting on this model yet"
ID = {TINY: "tiny", HUNDRED: "100t", HEAVY: "heavy"}

#: (contender, model, k) triples that miss their target on the current code (the default on
#: the 100-tensor model at k = 8 and model= on it at k = 1: medians above 1.04 in both full
#: runs, passing only inside an A/A spread widened by load; the default on the tiny MLP at
#: k = 8 since the window guard and the exception-safe boundary: about 45 us more per window
#: of 8 micro-steps, 1.06 -> 1.12)
MISSING: set[tuple[str, str, int]] = {
    (ACCUMOPT, TINY, 8),
    (ACCUMOPT_MODEL, TINY, 8),
    (ACCUMOPT, HUNDRED, 8),
    (ACCUMOPT, TINY, 1),
    (ACCUMOPT_MODEL, TINY, 1),
    (ACCUMOPT, HUNDRED, 1),
    (ACCUMOPT_MODEL, HUNDRED, 1),
}


def cases() -> list[object]:
    out = []
    for k in (8, 1):
        for model in (TINY, HUNDRED, HEAVY):
            for name in CONTENDERS:
                if k == 1 and name not in (ACCUMOPT, ACCUMOPT_MODEL):
                    continue
                marks = (
                    [pytest.mark.xfail(strict=False, reason=CLAIM)]
                    if (name, model, k) in MISSING
                    else []
                )
                ident = f"{ID[model]}-{name.replace(', ', '-').replace(' ', '_')}-k{k}"
                out.append(pytest.param(name, model, k, marks=marks, id=ident))
    return out


@pytest.mark.parametrize(("name", "model", "k"), cases())
def test_overhead(
    name: str, model: str, k: int, interleave: Interleave, installed: set[str]
) -> None:
    need(CONTENDERS[name], installed)
    work = workload(model, k)
    interleave(
        table=TABLE,
        contender_name=name,
        model=model,
        k=k,
        baseline=lambda: hand_window(copy.deepcopy(work.model), work.batches),
        contender=lambda n: contender_window(name, copy.deepcopy(work.model), work.batches, n),
        rounds=ROUNDS[model],
        warmup=WARMUP[model],
        target=TARGETS.get((model, k), 1.03) if name in (ACCUMOPT, ACCUMOPT_MODEL) else None,
        extra={"description": work.description},
    )

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

#: (contender, model, k) triples that miss their target on the current code (run of 2026-12-07
#: 15:20 UTC, a quiet machine, A/A spreads 0.03-0.10): the tiny MLP at k = 8 (1.150 default,
#: 1.249 model=) and k = 1 (1.297, 1.353); the default on 100 tensors (1.112 at k = 8, 1.114 at
#: k = 1); model= on 100 tensors at k = 1 (1.084, "passing" only inside its A/A spread). One
#: tiny-MLP pass's counting hooks and end-of-pass callback cost 8-13 us and the window's
#: boundary and first micro-step 60-80 us (see bench/RESULTS.md, "Where the time goes")
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

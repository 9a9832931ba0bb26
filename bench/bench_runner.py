"""Time per optimizer step of ``MicroBatchRunner`` against a hand-written micro-batch loop.

The models of ``bench_overhead.py`` at k = 8: per optimizer step, one batch of k x m rows (its k
micro-batches of m rows, concatenated), cut into micro-batches of m rows by the hand loop
(twice, as two copies A and B) and by the runner, with a fixed micro-batch size or with
``"auto"`` after its search settled (the loops: ``_loops.py``). All of them see the same
batches for the same number of steps, so their parameters must agree at the end: the largest
difference from copy A of the hand loop is stored as ``max_param_diff``.

Targets (issue 14): fixed size 1.05 on the tiny MLP and 1.03 on the 100-tensor model, auto
size 1.08 and 1.05; on the compute-heavy MLP (no target in the issue) 1.03 and 1.05.
"""

from __future__ import annotations

import copy

import pytest
from _harness import Interleave, cases
from _loops import (
    HEAVY,
    HUNDRED,
    RUNNER_AUTO,
    RUNNER_FIXED,
    RUNNERS,
    TINY,
    hand_micro_window,
    max_param_diff,
    whole_batch,
    workload,
)
from torch import nn

TABLE = "runner"
K = 8
# 21 rounds on the compute-heavy MLP: with 11 the fixed-size row read 1.117 (IQR 0.98-1.14)
# in the run of 2026-12-03 08:57 UTC and 1.018 (0.99-1.05) run alone right after it
ROUNDS = {TINY: 61, HUNDRED: 41, HEAVY: 21}
WARMUP = {TINY: 3, HUNDRED: 3, HEAVY: 1}
TARGETS = {
    (RUNNER_FIXED, TINY): 1.05,
    (RUNNER_FIXED, HUNDRED): 1.03,
    (RUNNER_FIXED, HEAVY): 1.03,
    (RUNNER_AUTO, TINY): 1.08,
    (RUNNER_AUTO, HUNDRED): 1.05,
    (RUNNER_AUTO, HEAVY): 1.05,
}
#: (runner, model) pairs that miss their target on the current code (run of 2026-12-07 15:20
#: UTC, a quiet machine, A/A spreads 0.02-0.10): fixed 1.457 on the tiny MLP and 1.075 on 100
#: tensors; auto 1.462 and 1.101 (the latter "passing" only inside its A/A spread); the
#: compute-heavy MLP passes both. 0.1 read 1.26 / 1.38 on the tiny MLP: the runner is a client
#: of the public API now, and a weighted micro-step through opt.backward(loss, items) with
#: model= costs about 26 us over a bare pass on that model (bench/RESULTS.md)
MISSING: set[tuple[str, str]] = {
    (RUNNER_FIXED, TINY),
    (RUNNER_FIXED, HUNDRED),
    (RUNNER_AUTO, TINY),
    (RUNNER_AUTO, HUNDRED),
    (RUNNER_AUTO, HEAVY),
}
ID = {TINY: "tiny", HUNDRED: "100t", HEAVY: "heavy", RUNNER_FIXED: "fixed", RUNNER_AUTO: "auto"}


GRID = [(name, model) for name in RUNNERS for model in (TINY, HUNDRED, HEAVY)]


@pytest.mark.parametrize(
    ("name", "model"), cases(GRID, MISSING, [f"{ID[m]}-{ID[n]}" for n, m in GRID])
)
def test_runner(name: str, model: str, interleave: Interleave) -> None:
    work = workload(model, K)
    batch, micro = whole_batch(work)
    models: list[nn.Module] = []

    def fresh() -> nn.Module:
        models.append(copy.deepcopy(work.model))
        return models[-1]

    missed = None
    try:
        interleave(
            table=TABLE,
            contender_name=name,
            model=model,
            k=K,
            baseline=lambda: hand_micro_window(fresh(), batch, micro),
            contender=lambda n: RUNNERS[name](fresh(), batch, micro),
            rounds=ROUNDS[model],
            warmup=WARMUP[model],
            target=TARGETS[name, model],
            baseline_name="hand micro-batch loop",
            extra={"description": work.description},
        )
    except pytest.fail.Exception as err:  # the timing missed its target; the run finished
        missed = err
    # stored before a miss is reported (the row's timings are stored by then too); models: the
    # calibration copy, A, B, then the contender's (A and the contender took the same steps on
    # the same batches)
    interleave.benchmark.extra_info["max_param_diff"] = max_param_diff(models[3], models[1])
    if missed is not None:
        raise missed

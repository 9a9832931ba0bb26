"""Import cost: ``import torch; import accumopt`` against ``import torch``, in fresh processes.

Every piece is a fresh interpreter (``python -c ...``) started from this process; its CPU time
(user + system, from ``os.wait4`` on exactly that child) and the wall time from spawn to exit
are what is compared. The baseline, ``import torch``, runs twice per round (A and B), in a
shuffled order with the contender, as every other benchmark here. Target (issue 14): 1.05.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from _harness import Interleave

TABLE = "import"
TARGET = 1.05
ROUNDS = 11
WARMUP = 1
BASELINE = "import torch"
CONTENDER = "import torch; import accumopt"


def child(code: str) -> tuple[int, int]:
    """Run ``python -c code``; its (CPU ns: user + system, wall ns)."""
    wall = time.perf_counter_ns()
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter_ns() - wall
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"python -c {code!r} exited with {proc.returncode}")
    return int((usage.ru_utime + usage.ru_stime) * 1e9), wall


def test_import(interleave: Interleave) -> None:
    interleave(
        table=TABLE,
        contender_name=CONTENDER,
        model="fresh interpreter",
        k=None,
        baseline=lambda: lambda: child(BASELINE),
        contender=lambda n: lambda: child(CONTENDER),
        rounds=ROUNDS,
        warmup=WARMUP,
        target=TARGET,
        baseline_name=BASELINE,
        min_piece_ms=0,
    )

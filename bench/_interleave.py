"""Interleaved rounds: a baseline twice (A and B) and one contender, in a shuffled order in every
round, each piece timed on two clocks (standard library only).

Every timing benchmark in this folder compares a *contender* with a *baseline* (a hand-written
loop, or ``import torch``) that runs twice per round, as two separate copies A and B. A round
runs the three pieces once each, in an order drawn at random for that round (a seeded
``random.Random``), so that machine noise, cache warmth and position effects hit every piece
alike. Per round it keeps two ratios:

- **contender / A**: the figure reported;
- **B / A**: the A/A ratio of two identical pieces, the floor of what this setup can resolve.
  Its interquartile range is the *A/A spread*.

Each piece is timed on the thread CPU clock (``time.thread_time_ns``: what the piece's own
thread ran, so other processes on a shared machine barely move it) and on the wall clock
(``time.perf_counter_ns``). Pieces that run elsewhere (a child process, the Lightning Trainer's
own thread) measure themselves and return ``(cpu_ns, wall_ns)``. The verdict is taken on the
CPU clock: a contender fails when its median ratio exceeds its target by more than the A/A
spread. The baseline's median CPU/wall ratio says how loaded the machine was (1.0: the thread
ran the whole time; lower: it waited for a core).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _common import quartiles

#: A piece: runs once; returns None (the caller times it) or its own (thread CPU ns, wall ns).
Piece = Callable[[], "tuple[int, int] | None"]
CLOCKS = ("cpu", "wall")
A, CONTENDER, B = "baseline A", "contender", "baseline B"


def timed(piece: Piece) -> tuple[int, int]:
    """Run ``piece`` once: its (thread CPU ns, wall ns), its own figures when it returns them."""
    cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
    own = piece()
    cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
    return own if own is not None else (cpu, wall)


@dataclass
class Rounds:
    """Plays interleaved rounds of baseline A, the contender and baseline B; keeps the counted
    times per piece and clock (nanoseconds)."""

    baseline_a: Piece
    contender: Piece
    baseline_b: Piece
    seed: int = 0
    counting: bool = True
    times: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    orders: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self.times = {role: {clock: [] for clock in CLOCKS} for role in (A, CONTENDER, B)}

    def play(self) -> None:
        """One round: the three pieces in a fresh random order."""
        pieces = {A: self.baseline_a, CONTENDER: self.contender, B: self.baseline_b}
        order = list(pieces)
        self._rng.shuffle(order)
        got = {role: timed(pieces[role]) for role in order}
        if self.counting:
            self.orders.append("".join(role[-1] if role != CONTENDER else "C" for role in order))
            for role, (cpu, wall) in got.items():
                self.times[role]["cpu"].append(cpu)
                self.times[role]["wall"].append(wall)

    def ratios(self, clock: str) -> tuple[list[float], list[float]]:
        """Per counted round: (contender / A, B / A) on ``clock``."""
        a = self.times[A][clock]
        return (
            [c / x for c, x in zip(self.times[CONTENDER][clock], a)],
            [b / x for b, x in zip(self.times[B][clock], a)],
        )


def summarize(rounds: Rounds, target: float | None) -> dict[str, Any]:
    """Everything a benchmark stores: per-round ratios and times, their quartiles, the A/A
    spread, the load and the verdict (``None`` target: reported, never failed)."""
    out: dict[str, Any] = {"rounds": len(rounds.times[A]["cpu"]), "orders": rounds.orders}
    for clock in CLOCKS:
        ratio, aa = rounds.ratios(clock)
        q = quartiles(ratio)
        qa = quartiles(aa)
        out[clock] = {
            "ratios": ratio,
            "aa_ratios": aa,
            "median": q[1],
            "q1": q[0],
            "q3": q[2],
            "aa_median": qa[1],
            "aa_q1": qa[0],
            "aa_q3": qa[2],
            "baseline_ms": quartiles([t / 1e6 for t in rounds.times[A][clock]])[1],
            "contender_ms": quartiles([t / 1e6 for t in rounds.times[CONTENDER][clock]])[1],
        }
    out["times_ns"] = rounds.times
    cpu = out["cpu"]
    spread = cpu["aa_q3"] - cpu["aa_q1"]
    out["aa_spread"] = spread
    out["target"] = target
    out["load_cpu_over_wall"] = quartiles(
        [c / w for c, w in zip(rounds.times[A]["cpu"], rounds.times[A]["wall"])]
    )[1]
    if target is None:
        out["verdict"] = "-"
    else:
        out["verdict"] = "PASS" if cpu["median"] <= target + spread else "FAIL"
    return out


def verdict_message(name: str, result: dict[str, Any]) -> str:
    """Why a benchmark failed its target, in one line."""
    cpu = result["cpu"]
    return (
        f"{name}: median thread-CPU ratio {cpu['median']:.3f} (IQR {cpu['q1']:.3f}-"
        f"{cpu['q3']:.3f}) > target {result['target']} + A/A spread {result['aa_spread']:.3f} "
        f"(A/A median {cpu['aa_median']:.3f}, {result['rounds']} rounds)"
    )

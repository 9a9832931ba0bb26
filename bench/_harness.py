"""The harness of the timing benchmarks: interleaved rounds through pytest-benchmark.

:class:`Interleave` (the ``interleave`` fixture of ``conftest.py``) plays one benchmark's rounds
(``_interleave.py``) through ``benchmark.pedantic``, stores the per-round ratios, their
quartiles, the A/A spread and the load in ``benchmark.extra_info`` (so they land in
``--benchmark-json``) and fails the test when the median thread-CPU ratio passes its target by
more than the A/A spread.
"""

from __future__ import annotations

import gc
import math
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _common import PEERS
from _interleave import Piece, Rounds, summarize, timed, verdict_message

RESULTS = pytest.StashKey[list[dict[str, Any]]]()
LOAD_START = pytest.StashKey[tuple[float, float, float]]()
THREADS = 1
PIECE_MS = 10.0  # a piece repeats its window until it lasts about this long


def calibrate(window: Piece, min_ms: float) -> int:
    """How many calls of ``window`` in a row last at least ``min_ms`` (one warm-up call, then
    one call timed on the thread CPU clock); 1 when ``min_ms`` is 0."""
    if min_ms <= 0:
        return 1
    window()
    cpu, _ = timed(window)
    return max(1, math.ceil(min_ms * 1e6 / max(cpu, 1)))


def repeated(window: Piece, n: int) -> Piece:
    """``window`` called ``n`` times in a row, as one piece (summing the figures of a window
    that times itself)."""
    if n == 1:
        return window

    def piece() -> tuple[int, int] | None:
        cpu = wall = 0
        own = False
        for _ in range(n):
            got = window()
            if got is not None:
                own = True
                cpu, wall = cpu + got[0], wall + got[1]
        return (cpu, wall) if own else None

    return piece


NOT_MET = "target from issue 14, not met yet"


def cases(grid: list[tuple[Any, ...]], missing: set[Any], ids: list[str]) -> list[object]:
    """``pytest.param`` for each pair of ``grid``, marked xfail (:data:`NOT_MET`, not strict: a
    pass shows as XPASS) where the pair is in ``missing`` (it misses its target today)."""
    xfail = [pytest.mark.xfail(strict=False, reason=NOT_MET)]
    return [
        pytest.param(*pair, marks=xfail if pair in missing else [], id=name)
        for pair, name in zip(grid, ids)
    ]


def quick(config: pytest.Config) -> bool:
    """Whether this session runs the quick variant."""
    return bool(config.getoption("--bench-quick"))


def counted_rounds(config: pytest.Config, full: int) -> int:
    """``full`` rounds, or about a fifth of them (at least 5) with ``--bench-quick``."""
    return max(5, full // 5) if quick(config) else full


def need(module: str | None, installed: set[str]) -> None:
    """Skip the calling benchmark when the peer ``module`` is missing, saying how to get it."""
    if module is not None and module not in installed:
        pytest.skip(
            f"{PEERS.get(module, module)} is not installed "
            "(pip install -c constraints.txt -e '.[bench]')"
        )


class Interleave:
    """Runs one benchmark's interleaved rounds through pytest-benchmark and records them."""

    def __init__(self, benchmark: Any, request: pytest.FixtureRequest) -> None:
        self.benchmark = benchmark
        self.request = request

    def __call__(
        self,
        *,
        table: str,
        contender_name: str,
        model: str,
        k: int | None,
        baseline: Callable[[], Piece],
        contender: Callable[[int], Piece],
        rounds: int,
        warmup: int,
        target: float | None,
        baseline_name: str = "hand loop",
        extra: dict[str, Any] | None = None,
        min_piece_ms: float = PIECE_MS,
        repeat_multiple: int = 1,
    ) -> dict[str, Any]:
        """Play ``warmup`` uncounted rounds, then ``rounds`` counted ones (through
        ``benchmark.pedantic``); store and return the summary, failing the test on a miss.

        ``baseline()`` is called three times (a copy to calibrate, A, B); ``contender(n)``
        builds the contender for ``n`` calls in all. A piece runs its window ``repeat`` times in
        a row, ``repeat`` chosen from one timed baseline call so that a piece lasts at least
        ``min_piece_ms``, rounded up to a multiple of ``repeat_multiple`` (a contender whose
        windows differ in a cycle of that many: every piece then holds whole cycles)."""
        config = self.request.config
        rounds = counted_rounds(config, rounds)
        repeat = calibrate(baseline(), min_piece_ms)  # a third copy: A and B stay in step
        repeat = -(-repeat // repeat_multiple) * repeat_multiple
        base_a, base_b = baseline(), baseline()
        window = contender((warmup + rounds) * repeat)
        played = Rounds(
            repeated(base_a, repeat),
            repeated(window, repeat),
            repeated(base_b, repeat),
            seed=zlib.crc32(self.request.node.nodeid.encode()),  # same order in any subset
        )
        self.benchmark.group = table
        gc.collect()
        gc.disable()  # as in timeit: a collection would land on whichever piece runs then
        try:
            played.counting = False
            for _ in range(warmup):
                played.play()
            played.counting = True
            if self.benchmark.disabled:  # --benchmark-disable: play the rounds ourselves
                for _ in range(rounds):
                    played.play()
            else:
                self.benchmark.pedantic(played.play, rounds=rounds, iterations=1)
        finally:
            gc.enable()
            close = getattr(window, "close", None)
            if close is not None:
                close()
        result = summarize(played, target)
        xfail = self.request.node.get_closest_marker("xfail")
        result.update(
            {
                "table": table,
                "contender": contender_name,
                "baseline": baseline_name,
                "model": model,
                "k": k,
                "warmup": warmup,
                "repeat": repeat,
                "threads": torch.get_num_threads(),
                "quick": quick(config),
                "xfail": xfail.kwargs.get("reason", "") if xfail else None,
                "test": self.request.node.nodeid,
                **(extra or {}),
            }
        )
        self.benchmark.extra_info.update(result)
        config.stash[RESULTS].append(result)
        if torch.get_num_threads() != THREADS:
            raise RuntimeError(
                f"something changed torch's thread count to {torch.get_num_threads()}"
            )
        if result["verdict"] == "FAIL":
            pytest.fail(verdict_message(f"{contender_name} on {model}", result), pytrace=False)
        return result

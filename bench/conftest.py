"""pytest-benchmark setup of the timing benchmarks: ``pytest bench/ --benchmark-only``.

Every benchmark plays interleaved rounds of its baseline (twice: A and B) and one contender
(``_interleave.py``) through ``benchmark.pedantic``, stores the per-round ratios, their
quartiles, the A/A spread and the machine's load in ``benchmark.extra_info`` (so they land in
``--benchmark-json``) and fails when its median thread-CPU ratio passes its target by more
than the A/A spread. At the end a summary table is printed.

Options: ``--bench-quick`` (or ``ACCUMOPT_BENCH_QUICK=1``): about a fifth of the rounds, for a
check that everything runs. Torch runs on one thread for the whole session.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from _common import machine
from _harness import LOAD_START, RESULTS, THREADS, Interleave, quick


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench-quick",
        action="store_true",
        default=os.environ.get("ACCUMOPT_BENCH_QUICK", "") not in ("", "0"),
        help="accumopt benchmarks: about a fifth of the rounds (also ACCUMOPT_BENCH_QUICK=1)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RESULTS] = []
    config.stash[LOAD_START] = os.getloadavg()
    torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def installed() -> set[str]:
    """The peers that can be imported (imported once here, their logging quietened)."""
    from _loops import quiet_peers

    found = set()
    for module in ("accelerate", "lightning", "mbp"):
        try:
            __import__(module)
        except ImportError:
            continue
        found.add(module)
    quiet_peers(found)
    return found


@pytest.fixture
def interleave(benchmark: Any, request: pytest.FixtureRequest) -> Interleave:
    """Run interleaved rounds: see :class:`Interleave`."""
    return Interleave(benchmark, request)


def pytest_benchmark_update_machine_info(
    config: pytest.Config, machine_info: dict[str, Any]
) -> None:
    machine_info["accumopt_bench"] = machine()


def pytest_benchmark_update_json(
    config: pytest.Config, benchmarks: list[Any], output_json: dict[str, Any]
) -> None:
    output_json["accumopt_bench"] = {
        "command": " ".join(["pytest", *sys.argv[1:]]),
        "quick": quick(config),
        "threads": THREADS,
        "loadavg_start": config.stash[LOAD_START],
        "loadavg_end": os.getloadavg(),
    }


def summary_lines(results: list[dict[str, Any]]) -> list[str]:
    """The summary table, one line per benchmark, grouped by table."""
    header = (
        "table",
        "contender",
        "model",
        "k",
        "CPU ratio (IQR)",
        "A/A (IQR)",
        "wall ratio",
        "target",
        "verdict",
        "load",
    )
    rows = []
    for r in sorted(results, key=lambda r: r["table"]):
        cpu, wall = r["cpu"], r["wall"]
        verdict = r["verdict"] + (" (xfail)" if r["xfail"] and r["verdict"] == "FAIL" else "")
        rows.append(
            (
                r["table"],
                r["contender"],
                r["model"],
                "-" if r["k"] is None else str(r["k"]),
                f"{cpu['median']:.3f} ({cpu['q1']:.3f}-{cpu['q3']:.3f})",
                f"{cpu['aa_median']:.3f} ({cpu['aa_q1']:.3f}-{cpu['aa_q3']:.3f})",
                f"{wall['median']:.3f}",
                "-" if r["target"] is None else f"{r['target']:.2f}",
                verdict,
                f"{r['load_cpu_over_wall']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS, [])
    if not results:
        return
    terminalreporter.section("accumopt benchmarks: ratios to the baseline")
    terminalreporter.write_line(
        "Medians over interleaved rounds of per-round ratios (thread CPU clock; wall clock in "
        "'wall ratio'); A/A: the baseline's second copy over its first; verdict: FAIL when the "
        "CPU median > target + A/A IQR; load: the baseline's median CPU/wall (1.00: idle "
        f"machine). torch threads: {THREADS}; quick: {quick(config)}."
    )
    for line in summary_lines(results):
        terminalreporter.write_line(line)

"""Helpers shared by the benchmark scripts (standard library only, so that importing this module
never imports torch: ``memory.py`` launches its measured children from a small process)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent

#: Peers compared with accumopt: import name -> distribution name on PyPI.
PEERS = {
    "accelerate": "accelerate",
    "lightning": "lightning",
    "mbp": "mbp-pytorch",
    "toma": "toma",
}


def available(module: str) -> bool:
    """Whether the peer ``module`` can be imported; prints a note naming the skip when not."""
    if importlib.util.find_spec(module) is not None:
        return True
    print(
        f"note: {PEERS.get(module, module)} is not installed; skipping it "
        "(pip install -c constraints.txt -e '.[bench]')"
    )
    return False


def version(distribution: str) -> str:
    """Installed version of ``distribution``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str]:
    """CPU model, core count, memory, Python and the versions of torch and the peers."""
    cpu = platform.processor() or platform.machine()
    mem_gib = ""
    meminfo = Path("/proc/meminfo")
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    if meminfo.exists():
        kib = int(meminfo.read_text().split()[1])  # first line: MemTotal: N kB
        mem_gib = f"{kib / 2**20:.0f} GiB"
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem_gib,
        "python": platform.python_version(),
        "torch": version("torch"),
    }
    info.update({dist: version(dist) for dist in PEERS.values()})
    return info


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``values``."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table (numeric-looking columns are right-aligned)."""
    align = ["---:" if all(_numeric(row[i]) for row in rows) else "---" for i in range(len(header))]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _numeric(cell: str) -> bool:
    head = cell.split(" ", 1)[0].rstrip("x%")
    try:
        float(head)
    except ValueError:
        return False
    return True


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """``--json PATH``: where a script writes its results for ``run_all.py``."""
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` (nothing when ``path`` is None)."""
    if path is not None:
        path.write_text(json.dumps(data, indent=1))

"""Peak memory of fresh child processes: how ``memory.py`` and ``memory_bf16.py`` measure.

Each configuration runs in a fresh interpreter (``python SCRIPT --child NAME --threads T``,
printing its result as one JSON line); the parent reads that child's own peak RSS with
``os.wait4`` on its pid and runs the configurations round-robin, so that slow drifts hit every
one of them. The parent must stay small (it imports no torch): Linux carries the peak RSS of
the address space a process leaves at ``exec`` into the child's ``ru_maxrss``, which the
"bare interpreter" configuration checks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from _common import add_json_option, write_json

BARE = "bare interpreter"
#: a parent larger than this would inflate its children's ru_maxrss (see the docstring)
MAX_BARE_MIB = 64.0


def parser(description: str) -> argparse.ArgumentParser:
    """The options every child-measuring script takes: --child, --children, --threads, --json."""
    out = argparse.ArgumentParser(description=description)
    out.add_argument("--child", help=argparse.SUPPRESS)
    out.add_argument("--children", type=int, default=3, help="fresh children per configuration")
    out.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    add_json_option(out)
    return out


def run_child(script: str, config: str, threads: int) -> dict[str, float]:
    """Run ``config`` of ``script`` in a fresh interpreter; its result plus its own peak RSS
    in MiB."""
    if config == BARE:
        command = [sys.executable, "-c", "pass"]
    else:
        command = [sys.executable, script, "--child", config, "--threads", str(threads)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # usage of exactly this child
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"child {config!r} failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1]) if config != BARE else {}
    return {**result, "peak_mib": usage.ru_maxrss / 1024}  # Linux reports KiB


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median, min and max peak RSS over a configuration's children, and its gradient norm."""
    peaks = sorted(run["peak_mib"] for run in runs)
    out = {"peak_mib": statistics.median(peaks), "min_mib": peaks[0], "max_mib": peaks[-1]}
    if "grad_norm" in runs[0]:
        out["grad_norm"] = runs[0]["grad_norm"]
    return out


def measure(
    script: str, configs: list[str], children: int, threads: int
) -> dict[str, dict[str, float]]:
    """Every configuration (``BARE`` among them) in ``children`` fresh children each,
    round-robin; their summaries. RuntimeError if the bare interpreter child shows a peak
    that the parent's size inflated."""
    runs: dict[str, list[dict[str, float]]] = {config: [] for config in configs}
    for _ in range(children):
        for config in configs:
            runs[config].append(run_child(script, config, threads))
    results = {config: summarize(config_runs) for config, config_runs in runs.items()}
    if results[BARE]["max_mib"] > MAX_BARE_MIB:
        raise RuntimeError(
            f"a bare interpreter child peaked at {results[BARE]['max_mib']:.0f} MiB: this "
            "process is too large to launch children whose ru_maxrss means their own peak"
        )
    return results


def main(
    argv: list[str] | None,
    script: str,
    configs: list[str],
    child: Callable[[str, int], dict[str, float]],
    table: Callable[[dict[str, dict[str, float]]], str],
    config: dict[str, Any],
    about: str = "",
) -> dict[str, Any]:
    """A measuring script's ``main``: as a child (``--child NAME``) run ``child`` and print its
    result; as the parent measure every configuration, print ``table`` of the results and
    return (and write, with ``--json``) them with ``config`` and the markdown."""
    args = parser(sys.modules["__main__"].__doc__ or "").parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return {}
    print(
        f"peak RSS of fresh child processes, median of {args.children} per configuration, "
        f"{args.threads} torch thread(s){about}"
    )
    results = measure(script, configs, args.children, args.threads)
    markdown = table(results)
    print(markdown)
    config = {**config, "threads": args.threads, "children": args.children}
    data = {"config": config, "results": results, "markdown": markdown}
    write_json(args.json, data)
    return data

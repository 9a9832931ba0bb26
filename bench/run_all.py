"""Run every benchmark, draw the plots and rewrite the measured sections of RESULTS.md.

1. The timing benchmarks: ``python -m pytest bench/ --benchmark-only
   --benchmark-json=bench/results.json`` (``--bench-quick`` with ``--quick``), or, with
   ``--from-json PATH``, the JSON of such a run made earlier (on another machine, say). Their
   tables (overhead, counting, import, runner) and ``overhead.png`` are generated from that
   JSON; a benchmark that missed its target does not stop the rest.
2. The scripts that do not time contenders against each other, each in its own process:
   ``memory.py``, ``autosize.py``, ``precision.py``, ``communication.py`` and
   ``memory_bf16.py``; they draw ``memory.png``, ``autosize.png`` and ``precision.png``.
3. RESULTS.md: the blocks between ``<!-- begin generated: NAME -->`` and
   ``<!-- end generated: NAME -->`` (NAME = setup, overhead, counting, import, runner_overhead,
   memory, autosize, precision, communication, noise, memory_bf16) are replaced; everything
   outside them (the exactness table, the prose) is left as it is.

Run: ``python bench/run_all.py [--quick] [--from-json PATH]`` (full: about 9 minutes on 2 cores;
quick: about 3).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import BENCH_DIR, available, markdown_table, version

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

RESULTS = BENCH_DIR / "RESULTS.md"
TIMING_JSON = BENCH_DIR / "results.json"
CONTENDER_ORDER = [
    "accumopt",
    "accumopt, model=",
    "Lightning Fabric",
    "mbp-pytorch",
    "Accelerate",
    "Lightning Trainer",
    "runner, fixed m",
    "runner, auto (settled)",
]


def run_script(script: str, args: list[str], json_path: Path) -> tuple[dict[str, Any], float]:
    """Run ``bench/<script>`` in a fresh interpreter; its JSON results and its wall time."""
    start = time.perf_counter()
    command = [sys.executable, str(BENCH_DIR / script), *args, "--json", str(json_path)]
    subprocess.run(command, check=True)
    return json.loads(json_path.read_text()), time.perf_counter() - start


def run_timing(quick: bool, json_path: Path) -> tuple[int, float]:
    """The pytest benchmarks, writing ``json_path``; pytest's exit status and the wall time."""
    start = time.perf_counter()
    root = BENCH_DIR.parent
    command = [
        sys.executable,
        "-m",
        "pytest",
        "bench/",
        "--benchmark-only",
        f"--benchmark-json={json_path.relative_to(root)}",
        "-q",
        *(["--bench-quick"] if quick else []),
    ]
    status = subprocess.run(command, check=False, cwd=root).returncode
    if not json_path.exists():
        raise SystemExit(f"pytest exited with {status} and wrote no {json_path}")
    return status, time.perf_counter() - start


# --- tables from the pytest-benchmark JSON -------------------------------------------------


def benchmarks(data: dict[str, Any], table: str) -> list[dict[str, Any]]:
    """The ``extra_info`` of every benchmark of ``table`` in a pytest-benchmark JSON."""
    return [b["extra_info"] for b in data["benchmarks"] if b["extra_info"].get("table") == table]


def _order(names: list[str]) -> list[str]:
    known = [n for n in CONTENDER_ORDER if n in names]
    return known + sorted(n for n in names if n not in known)


def cell(r: dict[str, Any]) -> str:
    """``median (q1-q3; A/A spread)`` on the thread CPU clock, with its verdict mark."""
    cpu = r["cpu"]
    mark = ""
    if r["verdict"] == "FAIL":
        mark = " FAIL (xfail)" if r.get("xfail") else " FAIL"
    return f"{cpu['median']:.3f} ({cpu['q1']:.2f}-{cpu['q3']:.2f}; A/A {r['aa_spread']:.3f}){mark}"


def grid(
    results: list[dict[str, Any]],
    corner: str,
    rows: list[str],
    row_key: str,
    cols: list[Any],
    col_key: str,
    fmt: Any,
) -> str:
    """A markdown table: one row per ``row_key`` value, one column per ``col_key`` value."""
    index = {(r[row_key], r[col_key]): r for r in results}
    body = [
        [str(row), *(fmt(index[row, col]) if (row, col) in index else "-" for col in cols)]
        for row in rows
    ]
    return markdown_table([corner, *map(str, cols)], body)


def load_line(results: list[dict[str, Any]]) -> str:
    """The rounds, repeats and load of a table's benchmarks, one sentence."""
    loads = [r["load_cpu_over_wall"] for r in results]
    rounds = sorted({r["rounds"] for r in results})
    return (
        f"Counted rounds per benchmark: {', '.join(map(str, rounds))}; load (the baseline's median "
        f"thread CPU / wall time per benchmark, 1.00 = it never waited for a core): "
        f"{min(loads):.2f}-{max(loads):.2f}."
    )


def contender_tables(results: list[dict[str, Any]], title: str) -> str:
    """Per k: ratio cells (contender rows, model columns), then ms per optimizer step (CPU)."""
    models = list(dict.fromkeys(r["model"] for r in results))
    out = []
    for k in sorted({r["k"] for r in results}, reverse=True):
        at_k = [r for r in results if r["k"] == k]
        names = _order(list(dict.fromkeys(r["contender"] for r in at_k)))
        out.append(
            f"**k = {k}**, {title}: thread-CPU median of the per-round ratio (IQR; A/A spread)."
        )
        out.append(grid(at_k, f"k = {k}", names, "contender", models, "model", cell))
        out.append(
            grid(
                at_k,
                f"ms per step, k = {k} (CPU: hand loop / contender; wall ratio)",
                names,
                "contender",
                models,
                "model",
                lambda r: (
                    f"{r['cpu']['baseline_ms'] / r.get('repeat', 1):.2f} / "
                    f"{r['cpu']['contender_ms'] / r.get('repeat', 1):.2f}; "
                    f"{r['wall']['median']:.3f}"
                ),
            )
        )
    targets = [r for r in results if r["target"] is not None]
    if targets:
        out.append(verdicts(targets))
    out.append(load_line(results))
    return "\n\n".join(out)


def verdicts(results: list[dict[str, Any]]) -> str:
    """One row per judged benchmark: ratio, A/A, target, verdict."""
    rows = [
        [
            r["contender"],
            r["model"],
            "-" if r["k"] is None else str(r["k"]),
            f"{r['cpu']['median']:.3f}",
            f"{r['cpu']['aa_median']:.3f} ({r['cpu']['aa_q1']:.3f}-{r['cpu']['aa_q3']:.3f})",
            f"{r['target']:.2f}",
            r["verdict"] + (f" (xfail: {r['xfail']})" if r.get("xfail") else ""),
        ]
        for r in results
    ]
    header = ["contender", "model", "k", "CPU ratio", "A/A (IQR)", "target", "verdict"]
    return markdown_table(header, rows)


def models_line(results: list[dict[str, Any]]) -> str:
    """The models a table measured, one sentence."""
    models = {r["model"]: r.get("description", "") for r in results}
    return "Models: " + "; ".join(f"**{n}**: {t}" for n, t in models.items()) + "."


def missing(table: str) -> str:
    """The block of a table that the JSON does not hold."""
    return f"Not measured in this run (no `{table}` benchmark in the pytest-benchmark JSON)."


def overhead_block(data: dict[str, Any]) -> str:
    results = benchmarks(data, "overhead")
    if not results:
        return missing("overhead")
    return (
        f"{models_line(results)}\n\n"
        + contender_tables(results, "contender / hand loop")
        + "\n\n![](overhead.png)"
    )


def runner_block(data: dict[str, Any]) -> str:
    results = benchmarks(data, "runner")
    if not results:
        return missing("runner")
    diffs = grid(
        results,
        "max abs param diff to hand loop",
        _order(list(dict.fromkeys(r["contender"] for r in results))),
        "contender",
        list(dict.fromkeys(r["model"] for r in results)),
        "model",
        lambda r: f"{r.get('max_param_diff', float('nan')):.1e}",
    )
    return (
        f"{models_line(results)}\n\n"
        + contender_tables(results, "runner / hand micro-batch loop")
        + "\n\n"
        + diffs
    )


def counting_block(data: dict[str, Any]) -> str:
    results = benchmarks(data, "counting")
    if not results:
        return missing("counting")
    models = list(dict.fromkeys(r["model"] for r in results))
    ks = sorted({r["k"] for r in results})
    parts = [models_line(results)]
    for way in dict.fromkeys(r["contender"] for r in results):
        mine = [r for r in results if r["contender"] == way]
        parts += [
            f"**{way}** / hand loop, thread-CPU median of the per-round ratio (IQR; A/A spread):",
            grid(mine, "model \\ k", models, "model", ks, "k", cell),
        ]
    return "\n\n".join([*parts, verdicts(results), load_line(results)])


def noise_block(data: dict[str, Any]) -> str:
    results = benchmarks(data, "noise scale")
    if not results:
        return missing("noise scale")
    return "\n\n".join([models_line(results), verdicts(results), load_line(results)])


def import_block(data: dict[str, Any]) -> str:
    results = benchmarks(data, "import")
    if not results:
        return missing("import")
    rows = [
        [
            r["contender"],
            f"{r['cpu']['baseline_ms']:.0f} / {r['cpu']['contender_ms']:.0f}",
            cell(r),
            f"{r['wall']['median']:.3f}",
            f"{r['target']:.2f}",
            r["verdict"],
        ]
        for r in results
    ]
    header = [
        "contender",
        "child CPU ms (import torch / contender)",
        "CPU ratio (IQR; A/A spread)",
        "wall ratio",
        "target",
        "verdict",
    ]
    return markdown_table(header, rows) + "\n\n" + load_line(results)


def setup_block(
    data: dict[str, Any], source: str, command: str, wall: float, timing_wall: float | None
) -> str:
    """The machine, versions, command, thread count and load of this run."""
    info = data["machine_info"].get("accumopt_bench", {})
    session = data.get("accumopt_bench", {})
    loads = [b["extra_info"].get("load_cpu_over_wall", 1.0) for b in data["benchmarks"]] or [1.0]
    timing = f" in {timing_wall:.0f} s" if timing_wall is not None else ""
    return (
        f"Machine: {info.get('cpu', '?')}, {info.get('cores', '?')} cores, "
        f"{info.get('memory', '?')}, no GPU; Python {info.get('python', '?')}, torch "
        f"{info.get('torch', '?')}, accelerate {info.get('accelerate', '?')}, lightning "
        f"{info.get('lightning', '?')}, mbp-pytorch {info.get('mbp-pytorch', '?')}, toma "
        f"{version('toma')}; {session.get('threads', 1)} torch thread. Timing tables: "
        f"`{session.get('command', 'pytest bench/ --benchmark-only')}`{timing}, "
        f"{data.get('datetime', '?')} (pytest-benchmark JSON `{source}`); load "
        f"average {_loadavg(session.get('loadavg_start'))} at its start, "
        f"{_loadavg(session.get('loadavg_end'))} at its end; the baselines' thread CPU / wall "
        f"{min(loads):.2f}-{max(loads):.2f}. This page: `{command}` in {wall:.0f} s."
    )


def _loadavg(values: list[float] | None) -> str:
    return "?" if not values else "/".join(f"{v:.2f}" for v in values)


# --- plots ---------------------------------------------------------------------------------


def new_figure(width: float, height: float) -> tuple[Figure, Axes]:
    """A figure drawn by the Agg backend (no pyplot, no display) and its one axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def plot_overhead(data: dict[str, Any], path: Path) -> None:
    """Grouped bars at k = 8: thread-CPU ratio to the hand loop per contender, one group per
    model, IQR whiskers; the grey band per group is the widest A/A interquartile range."""
    results = [r for r in benchmarks(data, "overhead") if r["k"] == 8]
    if not results:
        return
    models = list(dict.fromkeys(r["model"] for r in results))
    contenders = _order(list(dict.fromkeys(r["contender"] for r in results)))
    index = {(r["contender"], r["model"]): r for r in results}
    width = 0.8 / len(contenders)
    fig, ax = new_figure(9, 4.5)
    for j, model in enumerate(models):
        aa = [index[c, model] for c in contenders if (c, model) in index]
        low = min(r["cpu"]["aa_q1"] for r in aa)
        high = max(r["cpu"]["aa_q3"] for r in aa)
        ax.fill_between([j - 0.45, j + 0.45], low, high, color="grey", alpha=0.25, linewidth=0)
    for i, name in enumerate(contenders):
        xs, ratios, below, above = [], [], [], []
        for j, model in enumerate(models):
            if (name, model) not in index:
                continue
            cpu = index[name, model]["cpu"]
            xs.append(j + (i - (len(contenders) - 1) / 2) * width)
            ratios.append(cpu["median"])
            below.append(cpu["median"] - cpu["q1"])
            above.append(cpu["q3"] - cpu["median"])
        ax.bar(xs, ratios, width, yerr=[below, above], capsize=2, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("thread CPU per optimizer step / hand loop")
    rounds = sorted({r["rounds"] for r in results})
    ax.set_title(
        f"Overhead per optimizer step (k = 8, 1 thread, medians of {'/'.join(map(str, rounds))} "
        "rounds; whiskers: IQR; grey: A/A IQR)",
        fontsize="medium",
    )
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_memory(data: dict[str, Any], path: Path) -> None:
    """Horizontal bars: median peak RSS per configuration (whiskers: range over children),
    labelled with the ratio to batch 32."""
    results: dict[str, dict[str, float]] = data["results"]
    names = list(results)[::-1]
    peaks = [results[n]["peak_mib"] for n in names]
    reference = results["plain batch 32"]["peak_mib"]
    fig, ax = new_figure(9, 4)
    ranges = [
        [results[n]["peak_mib"] - results[n]["min_mib"] for n in names],
        [results[n]["max_mib"] - results[n]["peak_mib"] for n in names],
    ]
    bars = ax.barh(names, peaks, xerr=ranges, capsize=2, color="tab:blue")
    ax.bar_label(bars, [f" {p:.0f} MiB ({p / reference:.2f}x)" for p in peaks], fontsize="small")
    ax.axvline(reference, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("peak RSS of the child process, MiB (dashed: plain batch 32)")
    ax.set_xlim(0, max(peaks) * 1.3)
    config = data["config"]
    ax.set_title(
        f"Peak memory, effective batch {config['effective']} (conv net, CPU; median of "
        f"{config['children']} child(ren) each)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_autosize(data: dict[str, Any], path: Path) -> None:
    """Scatter: size found / limit against wasted forward passes (failed attempts; all of the
    passes of Lightning's finder), one marker per method, each point labelled with its limit;
    the shaded corner is accumopt's target."""
    fig, ax = new_figure(10.5, 4.5)
    config = data["config"]
    ax.fill_between([0.7, config["max_failures"]], 0.95, 1.04, color="tab:green", alpha=0.12)
    outcomes = [o for o in data["efficiency"] if o["found"] is not None]
    for marker, method in zip("o^sDv", dict.fromkeys(o["method"] for o in outcomes)):
        points = [o for o in outcomes if o["method"] == method]
        xs = [max(o["wasted_passes"], 0.8) for o in points]  # log axis: show 0 at 0.8
        ys = [o["found"] / o["limit"] for o in points]
        ax.scatter(xs, ys, marker=marker, s=45, label=method, alpha=0.8)
        for x, y, o in zip(xs, ys, points):
            ax.annotate(
                str(o["limit"]),
                (x, y),
                xytext=(4, 3),
                textcoords="offset points",
                fontsize="x-small",
            )
    ax.set_xscale("log")
    ax.set_ylim(0.45, 1.04)
    ax.set_xlabel("wasted forward passes (failed ones; Lightning: all of its finder's), log scale")
    ax.set_ylabel("size found / simulated limit L")
    ax.set_title(
        f"Auto-size search from {config['start']} (points labelled with L; shaded: "
        f">= 0.95 L with <= {config['max_failures']} failures)"
    )
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_precision(data: dict[str, Any], path: Path) -> None:
    """Relative gradient error vs micro-steps per window: float32 buffer, bf16 .grad, floor."""
    table = {int(k): v for k, v in data["table"].items()}
    ks = sorted(table)
    fig, ax = new_figure(6, 4)
    for key, label in (
        ("plain", "bf16 .grad sums"),
        ("buffer", "float32 window buffer"),
        ("floor", "one bf16 micro-batch (floor)"),
    ):
        ax.plot(ks, [table[k][key] for k in ks], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("micro-steps per window (k)")
    ax.set_ylabel("relative error of the window gradient")
    ax.set_title("bf16 accumulation error vs float64")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- RESULTS.md ----------------------------------------------------------------------------


def replace_block(text: str, name: str, body: str) -> str:
    """Replace the generated block ``name`` of RESULTS.md with ``body``."""
    pattern = re.compile(
        rf"(<!-- begin generated: {name} -->\n).*?(<!-- end generated: {name} -->)", re.DOTALL
    )
    if not pattern.search(text):
        raise SystemExit(f"{RESULTS} has no generated block {name!r}; restore its markers")
    return pattern.sub(lambda m: m.group(1) + body.strip() + "\n" + m.group(2), text, count=1)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks, draw the plots, rewrite RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="pytest --bench-quick, one child per memory configuration, fewer precision seeds",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=BENCH_DIR,
        help="folder of the RESULTS.md to rewrite and of the plots (default: bench/; a RESULTS.md "
        "missing there starts as a copy of bench/RESULTS.md)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="timing tables from this pytest-benchmark JSON instead of running pytest",
    )
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python bench/run_all.py", *given])
    start = time.perf_counter()
    timing_wall = None
    if args.from_json is None:
        status, timing_wall = run_timing(args.quick, TIMING_JSON)
        print(f"pytest bench/ --benchmark-only: exit status {status}, {timing_wall:.0f} s")
        source = TIMING_JSON
    else:
        source = args.from_json.resolve()
    timing = json.loads(source.read_text())
    shown = (
        source.relative_to(BENCH_DIR.parent) if source.is_relative_to(BENCH_DIR.parent) else source
    )
    with tempfile.TemporaryDirectory() as tmp:
        memory_args = ["--children", "1"] if args.quick else []
        memory, memory_s = run_script("memory.py", memory_args, Path(tmp, "m.json"))
        autosize, autosize_s = run_script("autosize.py", [], Path(tmp, "a.json"))
        precision_args = (
            ["--seeds", "2", "--ks", "16", "256", "--rounds", "5"] if args.quick else []
        )
        precision, precision_s = run_script("precision.py", precision_args, Path(tmp, "p.json"))
        comm_args = ["--windows", "5"] if args.quick else []
        comm, comm_s = run_script("communication.py", comm_args, Path(tmp, "c.json"))
        bf16, bf16_s = run_script("memory_bf16.py", memory_args, Path(tmp, "b.json"))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if available("matplotlib"):
        plot_overhead(timing, out / "overhead.png")
        plot_memory(memory, out / "memory.png")
        plot_autosize(autosize, out / "autosize.png")
        plot_precision(precision, out / "precision.png")
    wall = time.perf_counter() - start
    results = out / RESULTS.name
    text = (results if results.exists() else RESULTS).read_text()
    text = replace_block(text, "setup", setup_block(timing, str(shown), command, wall, timing_wall))
    text = replace_block(text, "overhead", overhead_block(timing))
    text = replace_block(text, "counting", counting_block(timing))
    text = replace_block(text, "import", import_block(timing))
    text = replace_block(text, "runner_overhead", runner_block(timing))
    text = replace_block(text, "memory", f"{memory['markdown']}\n\n![](memory.png)")
    text = replace_block(text, "autosize", f"{autosize['markdown']}\n\n![](autosize.png)")
    text = replace_block(text, "precision", f"{precision['markdown']}\n\n![](precision.png)")
    text = replace_block(text, "communication", comm["markdown"])
    text = replace_block(text, "noise", noise_block(timing))
    text = replace_block(text, "memory_bf16", bf16["markdown"])
    results.write_text(text)
    print(
        f"memory.py {memory_s:.0f} s, autosize.py {autosize_s:.0f} s, precision.py "
        f"{precision_s:.0f} s, communication.py {comm_s:.0f} s, memory_bf16.py {bf16_s:.0f} s, "
        f"total {wall:.0f} s; wrote "
        f"{results}, overhead.png, memory.png, autosize.png, precision.png"
    )


if __name__ == "__main__":
    main()

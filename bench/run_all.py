"""Run every benchmark, draw the plots and rewrite the measured sections of RESULTS.md.

Runs ``overhead.py``, ``memory.py``, ``runner_overhead.py``, ``autosize.py``, ``precision.py``
and ``communication.py`` (each in its own process), draws ``overhead.png``, ``memory.png``,
``autosize.png`` and ``precision.png`` and replaces the blocks of
``RESULTS.md`` between ``<!-- begin generated: NAME -->`` and ``<!-- end generated: NAME -->``
(NAME = setup, overhead, memory, runner_overhead, autosize, precision, communication);
everything outside those blocks (the exactness table, the prose) is left as it is.
``autosize.py`` takes seconds and always runs whole.

Run: ``python bench/run_all.py [--quick]`` (full: about 4 minutes on 2 cores; quick: about 1.5).
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

from _common import BENCH_DIR, available, machine, version

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

RESULTS = BENCH_DIR / "RESULTS.md"


def run_script(script: str, args: list[str], json_path: Path) -> tuple[dict[str, Any], float]:
    """Run ``bench/<script>`` in a fresh interpreter; its JSON results and its wall time."""
    start = time.perf_counter()
    command = [sys.executable, str(BENCH_DIR / script), *args, "--json", str(json_path)]
    subprocess.run(command, check=True)
    return json.loads(json_path.read_text()), time.perf_counter() - start


def new_figure(width: float, height: float) -> tuple[Figure, Axes]:
    """A figure drawn by the Agg backend (no pyplot, no display) and its one axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def plot_overhead(data: dict[str, Any], path: Path) -> None:
    """Grouped bars: ratio to the hand loop per contender, one group per model, IQR whiskers."""
    results: dict[str, dict[str, dict[str, float]]] = data["results"]
    models = list(results)
    contenders = [c for c in next(iter(results.values())) if c != "hand loop"]
    width = 0.8 / len(contenders)
    fig, ax = new_figure(9, 4.5)
    for i, name in enumerate(contenders):
        stats = [results[m][name] for m in models]
        xs = [j + (i - (len(contenders) - 1) / 2) * width for j in range(len(models))]
        ratios = [s["ratio"] for s in stats]
        whiskers = [[s["ratio"] - s["q1"] for s in stats], [s["q3"] - s["ratio"] for s in stats]]
        ax.bar(xs, ratios, width, yerr=whiskers, capsize=2, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("time per optimizer step / hand loop")
    config = data["config"]
    ax.set_title(
        f"Overhead per optimizer step (k={config['k']}, {config['threads']} thread, "
        f"median of {config['repeats']} rounds, whiskers: IQR)"
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


def replace_block(text: str, name: str, body: str) -> str:
    """Replace the generated block ``name`` of RESULTS.md with ``body``."""
    pattern = re.compile(
        rf"(<!-- begin generated: {name} -->\n).*?(<!-- end generated: {name} -->)", re.DOTALL
    )
    if not pattern.search(text):
        raise SystemExit(f"{RESULTS} has no generated block {name!r}; restore its markers")
    return pattern.sub(lambda m: m.group(1) + body.strip() + "\n" + m.group(2), text, count=1)


def setup_block(
    info: dict[str, str],
    overhead: dict[str, Any],
    memory: dict[str, Any],
    runner: dict[str, Any],
    quick: bool,
    wall: float,
) -> str:
    """The machine, versions, thread count and repeat counts of this run."""
    over, mem, run = overhead["config"], memory["config"], runner["config"]
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory']}, no GPU; "
        f"Python {info['python']}, torch {info['torch']}, accelerate {info['accelerate']}, "
        f"lightning {info['lightning']}, mbp-pytorch {info['mbp-pytorch']}, toma "
        f"{version('toma')}; {over['threads']} torch thread. Last regenerated by "
        f"`python bench/run_all.py{' --quick' if quick else ''}` in {wall:.0f} s: overhead "
        f"{over['repeats']} counted rounds after {over['warmup']} warm-up rounds, k = "
        f"{over['k']}; memory {mem['children']} fresh child(ren) per configuration; runner "
        f"overhead {run['repeats']} counted rounds after {run['warmup']} warm-up rounds, k = "
        f"{run['k']}."
    )


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


def models_line(data: dict[str, Any]) -> str:
    """The models a timing script measured, one sentence."""
    return "Models: " + "; ".join(f"**{n}**: {t}" for n, t in data["models"].items()) + "."


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks, draw the plots, rewrite RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="7 overhead rounds, one child per memory configuration"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        overhead_args = ["--quick"] if args.quick else []
        overhead, overhead_s = run_script("overhead.py", overhead_args, Path(tmp, "o.json"))
        memory_args = ["--children", "1"] if args.quick else []
        memory, memory_s = run_script("memory.py", memory_args, Path(tmp, "m.json"))
        runner, runner_s = run_script("runner_overhead.py", overhead_args, Path(tmp, "r.json"))
        autosize, autosize_s = run_script("autosize.py", [], Path(tmp, "a.json"))
        precision_args = ["--seeds", "2", "--ks", "16", "256"] if args.quick else []
        precision, precision_s = run_script("precision.py", precision_args, Path(tmp, "p.json"))
        comm_args = ["--windows", "5"] if args.quick else []
        comm, comm_s = run_script("communication.py", comm_args, Path(tmp, "c.json"))
    if available("matplotlib"):
        plot_overhead(overhead, BENCH_DIR / "overhead.png")
        plot_memory(memory, BENCH_DIR / "memory.png")
        plot_autosize(autosize, BENCH_DIR / "autosize.png")
        plot_precision(precision, BENCH_DIR / "precision.png")
    wall = time.perf_counter() - start
    text = RESULTS.read_text()
    setup = setup_block(machine(), overhead, memory, runner, args.quick, wall)
    text = replace_block(text, "setup", setup)
    text = replace_block(
        text, "overhead", f"{models_line(overhead)}\n\n{overhead['markdown']}\n\n![](overhead.png)"
    )
    text = replace_block(text, "memory", f"{memory['markdown']}\n\n![](memory.png)")
    text = replace_block(text, "runner_overhead", f"{models_line(runner)}\n\n{runner['markdown']}")
    text = replace_block(text, "autosize", f"{autosize['markdown']}\n\n![](autosize.png)")
    text = replace_block(text, "precision", f"{precision['markdown']}\n\n![](precision.png)")
    text = replace_block(text, "communication", comm["markdown"])
    RESULTS.write_text(text)
    print(
        f"overhead.py {overhead_s:.0f} s, memory.py {memory_s:.0f} s, runner_overhead.py "
        f"{runner_s:.0f} s, autosize.py {autosize_s:.0f} s, precision.py {precision_s:.0f} s, "
        f"communication.py {comm_s:.0f} s, "
        f"total {wall:.0f} s; wrote {RESULTS.name}, overhead.png, memory.png, autosize.png, "
        "precision.png"
    )


if __name__ == "__main__":
    main()

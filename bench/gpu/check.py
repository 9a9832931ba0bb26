"""One prepared check of accumopt on one NVIDIA GPU: overhead, and the auto-size search to OOM.

(a) **Overhead.** ``Accumulate(SGD, every=k)`` (counting at the parameters, and with
    ``model=``: at the outputs) with ``loss.backward(); opt.step(); opt.zero_grad()`` per
    micro-batch against the hand loop (``(loss / k).backward()``, step every k), target within
    2 % plus the A/A spread (the interquartile range of a second copy of the hand loop over
    the first, timed in the same rounds): the windows of ``bench/_loops.py``, on an fp32 MLP
    whose micro-batch is sized from a measured per-row peak to fill about a fifth of the card.
    Interleaved rounds (rotating order, warm-up rounds not counted), each window timed with
    CUDA events and followed by ``torch.cuda.synchronize()``; the figure is the median of the
    per-round ratios.
(b) **Auto size to a real CUDA OOM.** ``MicroBatchRunner(Accumulate(SGD, every_items=N),
    micro_batch_size="auto", device="cuda")`` on a model with large per-row activations and
    little compute (``Linear(256, 8192)``, 16 SiLUs that each keep an 8192-wide input for the
    backward pass, ``Linear(8192, 1)``), fed a pinned host batch of N rows that would need about
    1.5 times the card if run whole. Reported: the size it settled on (see
    ``bench/autosize.py``'s ``settle``), the OOMs it recovered from and the wall time of the
    search; the first window's gradient (captured by a step pre-hook on the inner optimizer)
    against a fixed-size micro-batch loop from the same initial weights (float32, TF32 off); and
    the largest size that really fits, found separately by bisection with ``empty_cache``
    between attempts.
(c) **Token budget.** ``bench/bench_token_budget.py``'s small causal transformer and windows of
    64 long-tailed sequences (host batches, micro-batches moved to the device): a row cap of 8
    rows, a hand-set budget of 2048 padded tokens and ``TokenBudget("auto")``; reported: real
    tokens (not padding) per second and peak memory of each, and the budget ``"auto"`` took.
(d) One short table, printed last (also written to ``check.json`` in ``--out``).

``--dry-run`` runs the same code on the CPU with tiny sizes, the OOM simulated by
``accumopt.testing.simulate_oom`` at a fixed limit. Run from the repository root with
``PYTHONPATH=.``: ``python bench/gpu/check.py [--dry-run] [--out DIR] [--tests STATUS]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # the sibling benchmark modules (they import each other by name)

from _common import markdown_table, quartiles  # noqa: E402
from _loops import (  # noqa: E402
    ACCUMOPT_MODEL,
    HAND,
    Window,
    accumopt_window,
    hand_window,
    settle,
    sum_loss,
)

from accumopt import Accumulate, MicroBatchRunner, is_oom  # noqa: E402
from accumopt.testing import simulate_oom  # noqa: E402

OVERHEAD_TARGET = 1.02  # within 2 % of the hand loop's throughput (plus the A/A spread)
HAND_AA = "hand loop (A/A)"
FOUND_TARGET = 0.95
ERROR_TARGET = 1e-5
LR = 1e-3


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the GPU's, or the dry run's (``rows_*``/``limit`` set there)."""

    device: str
    mlp_width: int
    mlp_depth: int
    k: int
    warmup: int
    repeats: int
    fill: float  # (a): fraction of the card the micro-batch's forward and backward may use
    wide_width: int
    wide_depth: int
    overfill: float  # (b): the whole batch needs this many times the free memory
    rows_a: int | None = None  # dry run: the micro-batch of (a)
    rows_b: int | None = None  # dry run: the whole batch of (b)
    limit: int | None = None  # dry run: the simulated limit of (b)


GPU = Plan("cuda", 1024, 8, 4, 1, 7, 0.2, 8192, 16, 1.5)
DRY = Plan("cpu", 64, 2, 4, 1, 3, 0.0, 32, 2, 0.0, rows_a=256, rows_b=2048, limit=300)
WIDE_IN = 256


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def memory_report(device: torch.device) -> str:
    """A one-line summary of the device's memory."""
    if device.type != "cuda":
        return f"{device}: no allocator statistics for this device"
    free, total = torch.cuda.mem_get_info(device)
    gib = 2.0**30
    return (
        f"{device}: {free / gib:.2f} GiB free of {total / gib:.2f} GiB, "
        f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB reserved by torch, peak allocated "
        f"{torch.cuda.max_memory_allocated(device) / gib:.2f} GiB"
    )


def play_rounds(windows: dict[str, Window], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Interleaved rounds: every window once per round, in an order that rotates from round to
    round; the wall seconds of the counted rounds per window."""
    names = list(windows)
    times: dict[str, list[float]] = {name: [] for name in names}
    for played in range(warmup + repeats):
        shift = played % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            windows[name]()
            if played >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def mlp(width: int, depth: int) -> nn.Sequential:
    """``depth`` x (Linear(width, width), ReLU), then Linear(width, 16)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


class Wide(nn.Module):
    """``Linear(256, width)``, ``depth`` SiLUs, ``Linear(width, 1)``: about (depth + 1) x width x
    4 bytes of activations per row for little compute."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp, self.out, self.depth = nn.Linear(WIDE_IN, width), nn.Linear(width, 1), depth

    def forward(self, x: Tensor) -> Tensor:
        """The output column (each SiLU keeps its input for the backward pass)."""
        h = self.inp(x)
        for _ in range(self.depth):
            h = F.silu(h)
        return self.out(h)  # type: ignore[no-any-return]


def bytes_per_row(model: nn.Module, inputs: int, outputs: int, device: torch.device) -> float:
    """Peak memory one more row adds to a forward and backward pass (inputs included), from the
    last two of three sizes (the first pass allocates cuBLAS's workspace; the difference cancels
    the gradients and the allocator's slack)."""
    peaks = []
    for rows in (1024, 2048, 4096):
        free_memory()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        x = torch.randn(rows, inputs, device=device)
        F.mse_loss(model(x), torch.zeros(rows, outputs, device=device)).backward()
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        model.zero_grad(set_to_none=True)
        del x
    free_memory()
    per_row = (peaks[2] - peaks[1]) / 2048
    if per_row <= 0:
        raise RuntimeError(f"peak memory did not grow with the rows: {peaks} bytes")
    return per_row


class Timed:
    """A window that records CUDA events around itself and synchronizes after it."""

    def __init__(self, window: Window, device: torch.device) -> None:
        self.window, self.device = window, device
        self.seconds: list[float] = []

    def __call__(self) -> None:
        """Run the window; on CUDA, append its event-timed seconds."""
        if self.device.type != "cuda":
            self.window()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.window()
        end.record()
        torch.cuda.synchronize(self.device)
        self.seconds.append(start.elapsed_time(end) / 1e3)


def overhead(plan: Plan, device: torch.device) -> dict[str, Any]:
    """(a): accumopt against the hand loop at a micro-batch that fills the card reasonably."""
    torch.manual_seed(0)
    model = mlp(plan.mlp_width, plan.mlp_depth).to(device)
    rows = plan.rows_a
    if rows is None:
        per_row = bytes_per_row(model, plan.mlp_width, 16, device)
        rows = int(plan.fill * torch.cuda.get_device_properties(device).total_memory / per_row)
    x = torch.randn(rows, plan.mlp_width, device=device)
    batches = [(x, torch.randn(rows, 16, device=device))] * plan.k
    factories = {
        HAND: hand_window,
        HAND_AA: hand_window,  # a second copy of the hand loop: the A/A ratio
        "accumopt": accumopt_window,
        ACCUMOPT_MODEL: functools.partial(accumopt_window, given=True),
    }
    timed = {n: Timed(f(copy.deepcopy(model), batches), device) for n, f in factories.items()}
    wall = play_rounds(dict[str, Window](timed), plan.warmup, plan.repeats)
    # CUDA event times where there are any (minus the warm-up), else the rounds' wall times.
    times = {
        name: t.seconds[plan.warmup :] if t.seconds else wall[name] for name, t in timed.items()
    }
    ratios = {
        name: quartiles([a / h for a, h in zip(times[name], times[HAND])])
        for name in factories
        if name != HAND
    }
    return {
        "rows": rows,
        "ratios": ratios,
        "hand_ms": 1e3 * quartiles(times[HAND])[1],
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if x.is_cuda else None,
    }


def limited(model: nn.Module, plan: Plan) -> Any:
    """The dry run's simulated limit, or (on the GPU) the same hook as a mere size recorder."""
    return simulate_oom(model, plan.limit if plan.limit is not None else sys.maxsize)


def fits(model: nn.Module, batch: tuple[Tensor, Tensor], rows: int, plan: Plan) -> bool:
    """Whether a forward and backward pass of ``rows`` rows runs (memory freed afterwards)."""
    device = torch.device(plan.device)
    ok = True
    with limited(model, plan):
        try:
            x, y = (t[:rows].to(device, non_blocking=True) for t in batch)
            sum_loss(model, (x, y)).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as err:  # only an OOM is an answer; anything else is a real failure
            if not is_oom(err):
                raise
            ok = False
    model.zero_grad(set_to_none=True)
    free_memory()
    return ok


def largest_fitting(model: nn.Module, batch: tuple[Tensor, Tensor], plan: Plan) -> int:
    """The largest row count whose forward and backward pass runs, by plain bisection."""
    lo, hi = 0, len(batch[0])
    if fits(model, batch, hi, plan):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(model, batch, mid, plan) else (lo, mid)
    return lo


def grads_of(model: nn.Module) -> list[Tensor]:
    """Copies of the parameters' gradients."""
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def relative_error(got: list[Tensor], want: list[Tensor]) -> float:
    """``||got - want|| / ||want||`` over all tensors together."""
    num = sum(float((g - w).double().pow(2).sum()) for g, w in zip(got, want))
    den = sum(float(w.double().pow(2).sum()) for w in want)
    return math.sqrt(num / den)


def autosize(plan: Plan, device: torch.device) -> dict[str, Any]:
    """(b): the runner's search to a real (or, dry, simulated) OOM, checked three ways."""
    torch.manual_seed(0)
    model = Wide(plan.wide_width, plan.wide_depth).to(device)
    start = copy.deepcopy(model.state_dict())
    rows, per_row = plan.rows_b, 0.0
    if rows is None:
        per_row = bytes_per_row(model, WIDE_IN, 1, device)
        rows = int(plan.overfill * torch.cuda.mem_get_info(device)[0] / per_row)
    batch = (torch.randn(rows, WIDE_IN), torch.randn(rows, 1))
    if device.type == "cuda":
        batch = (batch[0].pin_memory(), batch[1].pin_memory())
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every_items=rows)
    first: list[list[Tensor]] = []

    def capture(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not first:
            first.append(grads_of(model))

    opt.optimizer.register_step_pre_hook(capture)
    runner = MicroBatchRunner(
        opt,
        lambda b: sum_loss(model, b),
        micro_batch_size="auto",
        device=device,
        loss_reduction="sum",
    )
    began = time.perf_counter()
    with limited(model, plan) as record:
        found = settle(runner, batch, record.sizes, max_batches=20)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - began
    print(f"  settled: {found}, {runner.ooms} OOMs, {seconds:.1f} s; {memory_report(device)}")

    reference = Wide(plan.wide_width, plan.wide_depth).to(device)
    reference.load_state_dict(start)
    micro = max(1, found.size // 2)
    for i in range(0, rows, micro):
        x, y = (t[i : i + micro].to(device, non_blocking=True) for t in batch)
        (sum_loss(reference, (x, y)) / rows).backward()
    error = relative_error(first[0], grads_of(reference))
    reference.zero_grad(set_to_none=True)
    free_memory()
    largest = largest_fitting(reference, batch, plan)  # a bare model: no wrapper counts these
    return {
        "rows": rows,
        "whole_gib": rows * per_row / 2**30 if per_row else None,
        "size": found.size,
        "settled": found.settled,
        "batches": found.batches,
        "ooms": runner.ooms,
        "seconds": seconds,
        "error": error,
        "reference_micro": micro,
        "largest": largest,
        "ratio": found.size / largest,
    }


def token_budget(plan: Plan, device: torch.device) -> dict[str, Any]:
    """(c): tokens per second and peak memory of a row cap, a hand-set budget and ``"auto"``."""
    import bench_token_budget as tb  # imports pytest: here, so that (a) and (b) run without it

    data = tb.windows()
    real = sum(int(batch["lengths"].sum()) for batch in data) * plan.repeats
    settings = (("row cap, 8 rows", False, None), ("budget 2048", "pow2", tb.BUDGET))
    result: dict[str, Any] = {}
    for name, buckets, tokens in (*settings, ('budget "auto"', "pow2", "auto")):
        free_memory()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runner = tb.runner_for(tb.TinyLM().to(device), buckets, device, tokens)
        for batch in data[: plan.warmup]:
            runner(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(plan.repeats):
            for batch in data:
                runner(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result[name] = {
            "tokens_per_s": real / (time.perf_counter() - start),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
            if device.type == "cuda"
            else None,
            "budget": runner.micro_batch_size if runner.budget is not None else None,
            "ooms": runner.ooms,
        }
    return result


def attempt(name: str, part: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """Run one part; print and swallow its error (the table then marks it ERROR)."""
    print(f"== {name}", flush=True)
    began = time.perf_counter()
    try:
        result = part()
    except Exception:
        traceback.print_exc()
        return None
    print(f"  {json.dumps(result)} ({time.perf_counter() - began:.1f} s)", flush=True)
    return result


def verdict(ok: bool) -> str:
    """PASS or FAIL."""
    return "PASS" if ok else "FAIL"


def table(
    tests: str,
    plan: Plan,
    a: dict[str, Any] | None,
    b: dict[str, Any] | None,
    c: dict[str, Any] | None,
) -> str:
    """(d): one short table, a row per check."""
    outcome = {"passed": "PASS", "failed": "FAIL"}.get(tests.split(" ", 1)[0], "-")
    rows = [["test suite, CUDA tests included (run.sh)", tests, "pass", outcome]]
    if a is None:
        rows.append(["(a) overhead", "ERROR (see above)", f"<= {OVERHEAD_TARGET}", "FAIL"])
    else:
        aa_q1, _, aa_q3 = a["ratios"][HAND_AA]
        spread = aa_q3 - aa_q1
        for name, (q1, ratio, q3) in a["ratios"].items():
            judged = name != HAND_AA
            rows.append(
                [
                    f"(a) {name} / hand loop, MLP {plan.mlp_width}x{plan.mlp_depth}, "
                    f"{a['rows']} rows x k={plan.k}",
                    f"{ratio:.3f} (IQR {q1:.3f}-{q3:.3f}), hand {a['hand_ms']:.0f} ms/step"
                    + (f", peak {a['peak_gib']:.1f} GiB" if a["peak_gib"] else ""),
                    f"<= {OVERHEAD_TARGET} + A/A spread {spread:.3f}" if judged else "-",
                    verdict(ratio <= OVERHEAD_TARGET + spread) if judged else "-",
                ]
            )
    if b is None:
        rows.append(["(b) auto size", "ERROR (see above)", "-", "FAIL"])
    else:
        rows += [
            [
                f"(b) settled size, batch of {b['rows']} rows"
                + (f" ({b['whole_gib']:.0f} GiB if run whole)" if b["whole_gib"] else ""),
                f"{b['size']} after {b['ooms']} OOMs, {b['batches']} batches, {b['seconds']:.1f} s",
                "settles",
                verdict(b["settled"]),
            ],
            [
                "(b) found / largest that fits (bisection)",
                f"{b['size']} / {b['largest']} = {b['ratio']:.3f}",
                f">= {FOUND_TARGET}",
                verdict(b["ratio"] >= FOUND_TARGET),
            ],
            [
                f"(b) first update vs fixed {b['reference_micro']}-row loop (fp32)",
                f"relative error {b['error']:.1e}",
                f"< {ERROR_TARGET:.0e}",
                verdict(b["error"] < ERROR_TARGET),
            ],
        ]
    if c is None:
        rows.append(["(c) token budget", "ERROR (see above)", "-", "FAIL"])
    else:
        for name, got in c.items():
            peak = "" if got["peak_gib"] is None else f", peak {got['peak_gib']:.2f} GiB"
            took = "" if got["budget"] is None else f", budget {got['budget']} ({got['ooms']} OOMs)"
            rows.append(
                [
                    f"(c) {name}: real tokens per second",
                    f"{got['tokens_per_s']:,.0f}{peak}{took}",
                    "-",
                    "-",
                ]
            )
    return markdown_table(["check", "result", "target", "status"], rows)


def main(argv: list[str] | None = None) -> int:
    """Run (a), (b) and (c), print the table; 0 when every check passed (dry run: when all
    parts ran, whatever their figures on a CPU), else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, simulated OOM")
    parser.add_argument("--out", type=Path, help="where check.json goes (default: a temp dir)")
    parser.add_argument("--tests", default="not run", help="the test suite's outcome (run.sh)")
    args = parser.parse_args(argv)
    plan = DRY if args.dry_run else GPU
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available (use --dry-run on a machine without a GPU)")
        return 2
    device = torch.device(plan.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the CPU benchmarks: no oversubscribed intra-op threads
    torch.backends.cuda.matmul.allow_tf32 = False  # exact float32 for the comparison in (b)
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: {name}; {plan}")
    a = attempt("(a) overhead", lambda: overhead(plan, device))
    free_memory()
    b = attempt("(b) auto size to OOM", lambda: autosize(plan, device))
    free_memory()
    c = attempt("(c) token budget", lambda: token_budget(plan, device))
    markdown = table(args.tests, plan, a, b, c)
    out = args.out or Path(tempfile.mkdtemp(prefix="accumopt-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "plan": plan.__dict__, "a": a, "b": b, "c": c, "table": markdown}
    (out / "check.json").write_text(json.dumps(report, indent=1))
    print(f"(results in {out / 'check.json'})\n")
    print(markdown)
    ran = a is not None and b is not None and c is not None
    return 0 if ran and (args.dry_run or "FAIL" not in markdown) else 1


if __name__ == "__main__":
    sys.exit(main())

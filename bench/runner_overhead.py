"""Time per optimizer step of ``MicroBatchRunner`` against a hand-written micro-batch loop.

The models and data are those of ``overhead.py``: per optimizer step, one batch of k x m rows
(its k micro-batches of m rows, concatenated). Every contender trains its own deep copy of the
model with plain SGD on that batch, cut into micro-batches of m rows:

- **hand loop**: for each slice of m rows, forward and ``(loss_sum / n).backward()`` (n = k x m
  rows), then one ``step()`` and ``zero_grad()``;
- **runner, fixed m**: ``MicroBatchRunner(Accumulate(SGD, every_items=n), loss_fn,
  micro_batch_size=m)`` called once on the batch (``loss_fn`` returns the summed loss);
- **runner, auto (settled)**: ``micro_batch_size="auto"`` (start at the whole batch). Before
  timing it trains under ``simulate_oom(model, m)`` until its search settled at m; then the
  simulated limit is lifted and the parameters are reset, so the timed steps run at m with no
  OOM. Its one standing cost is the rollback buffer that ``"auto"`` turns on: each
  micro-batch's gradient is folded into the window buffer so that a failed one can be dropped
  alone.

Rounds, rotation, warm-up, garbage collection and the median ratio are as in ``overhead.py``.
All contenders see the same batches for the same number of steps, so their parameters must
agree at the end: the largest difference from the hand loop's is reported too.

Run: ``python bench/runner_overhead.py [--quick] [--repeats 31] [--k 8] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    add_json_option,
    add_round_options,
    markdown_table,
    round_counts,
    write_json,
)
from autosize import settle, sum_loss
from overhead import HAND, LR, Rounds, Window, summarize, tables, workloads
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner
from accumopt.testing import simulate_oom

Batch = tuple[Tensor, Tensor]
FIXED = "runner, fixed m"
AUTO = "runner, auto (settled)"
TARGET = 1.03


def hand_window(model: nn.Module, batch: Batch, micro: int) -> Window:
    """Slice, forward, ``(loss_sum / n).backward()`` per micro-batch; step and zero at the end."""
    x, y = batch
    n = len(x)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def window() -> None:
        for i in range(0, n, micro):
            (sum_loss(model, (x[i : i + micro], y[i : i + micro])) / n).backward()
        opt.step()
        opt.zero_grad()

    return window


def make_runner(model: nn.Module, n: int, micro: int | None) -> MicroBatchRunner:
    """A runner over ``Accumulate(SGD, every_items=n)``: fixed ``micro`` rows, or "auto"."""
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every_items=n)
    return MicroBatchRunner(
        opt, lambda b: sum_loss(model, b), micro_batch_size="auto" if micro is None else micro
    )


def fixed_window(model: nn.Module, batch: Batch, micro: int) -> Window:
    """One runner call per step, at a fixed micro-batch size."""
    runner = make_runner(model, len(batch[0]), micro)

    def window() -> None:
        runner(batch)

    return window


def auto_window(model: nn.Module, batch: Batch, micro: int) -> Window:
    """One runner call per step with ``"auto"``, after its search settled at ``micro`` rows under
    a simulated limit (then lifted, and the parameters reset to where they started)."""
    start = copy.deepcopy(model.state_dict())
    runner = make_runner(model, len(batch[0]), None)
    with simulate_oom(model, micro) as record:
        found = settle(runner, batch, record.sizes, max_batches=20)
    if not found.settled or found.size != micro:
        raise RuntimeError(f"the search settled at {found} instead of {micro} rows")
    model.load_state_dict(start)
    changes = len(runner.history)

    def window() -> None:
        runner(batch)
        if len(runner.history) != changes:
            raise RuntimeError(f"the settled size changed while timing: {runner.history}")

    return window


#: contender -> factory of its window (the hand loop is the reference).
CONTENDERS: dict[str, Callable[[nn.Module, Batch, int], Window]] = {
    HAND: hand_window,
    FIXED: fixed_window,
    AUTO: auto_window,
}


def measure(
    model: nn.Module, batch: Batch, micro: int, warmup: int, repeats: int
) -> tuple[Rounds, dict[str, nn.Module]]:
    """Play ``warmup + repeats`` rounds; the rounds and each contender's trained model."""
    models = {name: copy.deepcopy(model) for name in CONTENDERS}
    windows = {name: factory(models[name], batch, micro) for name, factory in CONTENDERS.items()}
    rounds = Rounds(windows, warmup)
    gc.collect()
    gc.disable()
    try:
        for _ in range(warmup + repeats):
            rounds.play()
    finally:
        gc.enable()
    return rounds, models


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the parameters of two copies of a model."""
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every workload, print the tables and return (and optionally save) the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_options(parser, "micro-batches")
    add_json_option(parser)
    args = parser.parse_args(argv)
    repeats, warmup = round_counts(args)
    torch.set_num_threads(1)
    logging.getLogger("accumopt").setLevel(logging.ERROR)  # the settling OOMs, one line each
    print(
        f"torch {torch.__version__}, 1 thread, k={args.k}, SGD, median of {repeats} "
        f"interleaved rounds after {warmup} warm-up rounds"
    )
    results, models = {}, {}
    diffs: dict[str, list[str]] = {FIXED: [], AUTO: []}
    for work in workloads(args.k):
        start = time.perf_counter()
        batch = (torch.cat([x for x, _ in work.batches]), torch.cat([y for _, y in work.batches]))
        micro = len(work.batches[0][0])
        rounds, trained = measure(work.model, batch, micro, warmup, repeats)
        results[work.name] = summarize(rounds, list(CONTENDERS))
        models[work.name] = work.description
        for name, cells in diffs.items():
            cells.append(f"{max_param_diff(trained[name], trained[HAND]):.1e}")
        print(f"  {work.name} ({work.description}): {time.perf_counter() - start:.1f} s")
    verdicts = [
        [name] + ["PASS" if results[m][name]["ratio"] <= TARGET else "FAIL" for m in results]
        for name in diffs
    ]
    markdown = "\n\n".join(
        [
            tables(results),
            markdown_table([f"median ratio <= {TARGET}", *results], verdicts),
            markdown_table(
                ["max abs param diff to hand loop", *results],
                [[name, *cells] for name, cells in diffs.items()],
            ),
        ]
    )
    print(markdown)
    config = {"k": args.k, "threads": 1, "repeats": repeats, "warmup": warmup}
    data = {"config": config, "models": models, "results": results, "markdown": markdown}
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()

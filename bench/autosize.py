"""Auto micro-batch sizing: accumopt's in-training search against the peers' batch-size finders.

A tiny model (``Linear(8, 1)``) is wrapped by ``accumopt.testing.simulate_oom(model.body, L)``:
every forward pass of more than L rows raises a real ``torch.OutOfMemoryError``, and every
forward pass (successful or not) is recorded with its row count. Each method searches from its
own starting point against the same limit, driven through its real code:

- **accumopt**: ``MicroBatchRunner(Accumulate(SGD, every_items=4096), loss_fn,
  micro_batch_size="auto", start_size=4096)`` trains on batches of 4096 rows until it settled
  (a batch without OOM that starts at the same size as the previous batch); the size found is
  the first micro-batch size of that last batch. Its successful attempts are real micro-batches
  of the window, so only the failed attempts are wasted.
- **Accelerate**: ``find_executable_batch_size(starting_batch_size=4096)`` around a function that
  runs one SGD step (forward, backward, step) on that many rows; on OOM it restarts the function
  at 0.9 times the size. Failed calls are wasted.
- **Lightning power / binsearch**: ``Tuner(trainer).scale_batch_size(module, mode=...)`` with
  its defaults (``init_val=2``, ``max_trials=25``, ``steps_per_trial=3``, ``max_val=8192``,
  binsearch ``margin=0.05``) on a 16384-row data set. The finder runs before training and
  restores the initial checkpoint afterwards, so all its passes are wasted.
- **toma**: ``toma.simple.batch(step, 4096)``, halving on OOM. Failed calls are wasted.

The cost of a search is given in wasted rows (the rows of the wasted passes) and in wasted rows
per row trained: the rows of the passes that did train (accumopt's successful micro-batches
while it searched, the peers' one successful step; none for Lightning's finder).

The peers recognise OOM by message text, accumopt by type first (``torch.OutOfMemoryError``) and
then by the known texts. The efficiency table uses ``torch.OutOfMemoryError`` with torch's own
CUDA text, which every method recognises. The recognition table repeats every method at one
limit with four errors: accumopt's simulated typed error ("CUDA out of memory (simulated
...)"), torch's CUDA text, a typed error with another text ("XPU allocation failed"), and the
plain ``RuntimeError`` of torch's CPU allocator; and it checks what a real CPU allocation
failure in this torch raises.

Run: ``python bench/autosize.py [--json PATH]`` (a few seconds, so ``run_all.py`` always runs
all of it).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import add_json_option, available, markdown_table, write_json
from _loops import quiet_peers, settle, sum_loss
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from accumopt import Accumulate, MicroBatchRunner, is_oom
from accumopt.testing import simulate_oom

START = 4096
FEATURES = 8
LIMITS = (37, 100, 1000, 3000)
RECOGNITION_LIMIT = 100
MAX_BATCHES = 20
LR = 1e-3
MAX_FAILURES = math.ceil(math.log2(START)) + 3  # the target: 15 failed attempts at most
CUDA_TEXT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 1.06 GiB is free. Including non-PyTorch memory, this process has 138.74 GiB "
    "memory in use."
)
XPU_TEXT = "XPU allocation failed: 2.00 GiB requested, 0.50 GiB free"
CPU_TEXT = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
)

#: error name -> the error raised instead of accumopt.testing's (None: keep accumopt's own).
ERRORS: dict[str, Callable[[], RuntimeError] | None] = {
    "simulated, typed": None,
    "CUDA text, typed": lambda: torch.OutOfMemoryError(CUDA_TEXT),
    "XPU text, typed": lambda: torch.OutOfMemoryError(XPU_TEXT),
    "CPU allocator, RuntimeError": lambda: RuntimeError(CPU_TEXT),
}
EFFICIENCY_ERROR = "CUDA text, typed"


class Net(nn.Module):
    """``Linear(8, 1)`` whose out-of-memory errors (from ``simulate_oom`` on ``body``) are
    re-raised as the chosen error."""

    def __init__(self, error: Callable[[], RuntimeError] | None) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 1)
        self.error = error

    def forward(self, x: Tensor) -> Tensor:
        """The body's output; the chosen error instead of a simulated OOM."""
        try:
            return self.body(x)  # type: ignore[no-any-return]
        except torch.OutOfMemoryError as err:
            if self.error is None:
                raise
            raise self.error() from err


def sgd_step(net: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, rows: int) -> int:
    """One plain SGD step on the first ``rows`` rows (the function the peers retry)."""
    F.mse_loss(net(x[:rows]), y[:rows]).backward()
    opt.step()
    opt.zero_grad()
    return rows


def run_accumopt(net: Net, x: Tensor, y: Tensor, sizes: list[int]) -> int:
    """accumopt's in-training search on batches of ``START`` rows; the settled size."""
    opt = Accumulate(torch.optim.SGD(net.parameters(), lr=LR), every_items=START)
    runner = MicroBatchRunner(
        opt,
        lambda b: sum_loss(net, b),
        micro_batch_size="auto",
        start_size=START,
        loss_reduction="sum",
    )
    return settle(runner, (x[:START], y[:START]), sizes, MAX_BATCHES).size


def run_accelerate(net: Net, x: Tensor, y: Tensor, sizes: list[int]) -> int:
    """Accelerate's ``find_executable_batch_size`` around one SGD step."""
    from accelerate.utils import find_executable_batch_size

    opt = torch.optim.SGD(net.parameters(), lr=LR)

    @find_executable_batch_size(starting_batch_size=START)  # type: ignore[untyped-decorator]
    def train(batch_size: int) -> int:
        return sgd_step(net, opt, x, y, batch_size)

    return int(train())


def run_toma(net: Net, x: Tensor, y: Tensor, sizes: list[int]) -> int:
    """toma's ``simple.batch`` around one SGD step."""
    from toma import simple

    opt = torch.optim.SGD(net.parameters(), lr=LR)
    return int(simple.batch(lambda rows: sgd_step(net, opt, x, y, rows), START))


def lightning_finder(mode: str) -> Callable[[Net, Tensor, Tensor, list[int]], int]:
    """Lightning's batch-size finder (``Tuner.scale_batch_size``) in ``mode``, with defaults."""

    def run(net: Net, x: Tensor, y: Tensor, sizes: list[int]) -> int:
        import lightning as L
        from lightning.pytorch.tuner import Tuner

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = net
                self.batch_size = 1  # the finder sets it (init_val=2 first)

            def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
                return F.mse_loss(self.net(batch[0]), batch[1])

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=LR)

            def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
                return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)

        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=root,
            )
            return int(Tuner(trainer).scale_batch_size(Module(), mode=mode) or 0)

    return run


@dataclass
class Method:
    """A contender: the module it needs, how to run its search, and whether all of its passes
    are outside training (a finder that runs first and restores the model)."""

    module: str | None
    run: Callable[[Net, Tensor, Tensor, list[int]], int]
    all_wasted: bool


METHODS = {
    "accumopt": Method(None, run_accumopt, False),
    "Accelerate": Method("accelerate", run_accelerate, False),
    "Lightning power": Method("lightning", lightning_finder("power"), True),
    "Lightning binsearch": Method("lightning", lightning_finder("binsearch"), True),
    "toma": Method("toma", run_toma, False),
}


@dataclass
class Outcome:
    """One search: what it found (None: an error escaped it) and what it cost."""

    method: str
    limit: int
    error: str
    found: int | None
    escaped: str | None
    failed: int
    passes: int
    wasted_passes: int
    wasted_rows: int
    trained_rows: int


def search(name: str, limit: int, error: str) -> Outcome:
    """Run method ``name`` against a simulated limit of ``limit`` rows raising ``error``."""
    method = METHODS[name]
    torch.manual_seed(0)
    net = Net(ERRORS[error])
    x, y = torch.randn(4 * START, FEATURES), torch.randn(4 * START, 1)
    found, escaped = None, None
    with simulate_oom(net.body, limit) as record:
        try:
            found = method.run(net, x, y, record.sizes)
        except Exception as err:  # reported, not raised: a peer that misses the error
            escaped = type(err).__name__
    wasted = record.sizes if method.all_wasted else record.raised
    trained = 0 if method.all_wasted else sum(record.sizes) - sum(record.raised)
    return Outcome(
        name,
        limit,
        error,
        found,
        escaped,
        len(record.raised),
        len(record.sizes),
        len(wasted),
        sum(wasted),
        trained,
    )


def efficiency_table(outcomes: list[Outcome]) -> str:
    """One row per method and limit, with the targets checked on accumopt's rows."""
    rows = []
    for o in outcomes:
        if o.found is None:
            rows.append([o.method, str(o.limit), f"missed ({o.escaped})", *["-"] * 8])
            continue
        target = "-"
        if o.method == "accumopt":
            ok = o.found >= 0.95 * o.limit and o.failed <= MAX_FAILURES
            target = "PASS" if ok else "FAIL"
        rows.append(
            [
                o.method,
                str(o.limit),
                str(o.found),
                f"{o.found / o.limit:.3f}",
                str(o.failed),
                str(o.passes),
                str(o.wasted_passes),
                str(o.wasted_rows),
                str(o.trained_rows),
                f"{o.wasted_rows / o.trained_rows:.2f}" if o.trained_rows else "all wasted",
                target,
            ]
        )
    header = [
        "method",
        "L",
        "size found",
        "found/L",
        "failed attempts",
        "forward passes",
        "wasted passes",
        "wasted rows",
        "rows trained",
        "wasted / trained",
        f"target (>= 0.95 L, <= {MAX_FAILURES} failed)",
    ]
    return markdown_table(header, rows)


def recognition_table(outcomes: list[Outcome], methods: list[str]) -> str:
    """One row per error, one column per method: found size, or the error that escaped."""
    cells: dict[tuple[str, str], str] = {
        (o.error, o.method): (
            f"missed: {o.escaped} escaped" if o.found is None else f"{o.found} ({o.failed} failed)"
        )
        for o in outcomes
    }
    rows = [[error, *(cells[error, m] for m in methods)] for error in ERRORS]
    return markdown_table([f"error (L = {RECOGNITION_LIMIT})", *methods], rows)


def real_cpu_failure(installed: set[str]) -> str:
    """What a real CPU allocation failure raises in this torch, and who recognises it."""
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except Exception as caught:  # the error object is what the predicates are asked about
        err = caught
    else:
        return "a 4 EiB CPU allocation did not fail on this machine"
    checks: dict[str, Callable[[BaseException], bool]] = {"accumopt": is_oom}
    if "accelerate" in installed:
        from accelerate.utils.memory import should_reduce_batch_size

        checks["Accelerate"] = should_reduce_batch_size
    if "lightning" in installed:
        from lightning.pytorch.utilities.memory import is_oom_error

        checks["Lightning"] = is_oom_error
    if "toma" in installed:
        from toma import should_reduce_batch_size as toma_check

        checks["toma"] = toma_check
    verdicts = ", ".join(f"{name} {'yes' if ok(err) else 'no'}" for name, ok in checks.items())
    return (
        f"A real CPU allocation failure in torch {torch.__version__} "
        f"(`torch.empty(2**62, dtype=torch.uint8)`) raises `{type(err).__name__}` (a "
        f"`torch.OutOfMemoryError`: {isinstance(err, torch.OutOfMemoryError)}); recognised as "
        f"out-of-memory by: {verdicts}."
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every search, print the tables and return (and optionally save) the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    installed = {m for m in ("accelerate", "lightning", "toma") if available(m)}
    quiet_peers(installed)
    logging.getLogger("accumopt").setLevel(logging.ERROR)  # one warning per OOM otherwise
    # Every method collects garbage after each OOM (Accelerate and Lightning before every try
    # too); freezing what the imports allocated keeps each collection from walking torch's and
    # Lightning's objects (seconds per search otherwise; the counts are the same either way).
    gc.freeze()
    methods = [n for n, m in METHODS.items() if m.module is None or m.module in installed]
    start = time.perf_counter()
    efficiency = [search(m, limit, EFFICIENCY_ERROR) for m in methods for limit in LIMITS]
    recognition = [
        next(o for o in efficiency if o.method == m and o.limit == RECOGNITION_LIMIT)
        if error == EFFICIENCY_ERROR
        else search(m, RECOGNITION_LIMIT, error)
        for error in ERRORS
        for m in methods
    ]
    markdown = (
        efficiency_table(efficiency)
        + "\n\n"
        + recognition_table(recognition, methods)
        + "\n\n"
        + real_cpu_failure(installed)
    )
    print(markdown)
    print(f"searches: {time.perf_counter() - start:.1f} s")
    config = {"start": START, "limits": list(LIMITS), "max_failures": MAX_FAILURES}
    data = {
        "config": config,
        "efficiency": [asdict(o) for o in efficiency],
        "recognition": [asdict(o) for o in recognition],
        "markdown": markdown,
    }
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()

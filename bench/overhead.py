"""Time per optimizer step of accumopt, a hand-written accumulation loop and the peers.

Every contender trains its own deep copy of the same model (accumopt's wrapper counts every
backward pass through its parameters, so contenders must not share parameters) on the same k
micro-batches per optimizer step, with plain SGD:

- **hand loop**: ``(loss / k).backward()`` on every micro-batch, step and zero every k;
- **accumopt**: ``loss.backward(); opt.step(); opt.zero_grad()`` on every micro-batch, with
  ``Accumulate(SGD, every=k)`` (backward passes counted at the parameters);
- **accumopt, model=**: the same loop with ``Accumulate(SGD, every=k, model=model)`` (counted at
  the model's outputs);
- **Accelerate**: ``Accelerator(cpu=True, gradient_accumulation_steps=k)``, ``prepare``d model
  and optimizer, ``with accelerator.accumulate(model):`` around forward, ``accelerator.backward``,
  ``opt.step()`` and ``opt.zero_grad()`` on every micro-batch;
- **Lightning Fabric**: ``fabric.setup`` model and optimizer, forward and ``fabric.backward(loss /
  k)`` under ``fabric.no_backward_sync(model, enabled=not boundary)``, step and zero every k;
- **Lightning Trainer**: ``Trainer(accumulate_grad_batches=k)`` fitting a ``LightningModule``
  whose ``training_step`` returns the loss (no logger, progress bar, checkpoints or validation);
- **mbp-pytorch**: one ``@mbp.apply(..., ub_size=micro)`` call on the k micro-batches as one batch
  of k * micro rows, then ``opt.step(); opt.zero_grad()``.

One *window* is the k micro-steps and the optimizer step. A *round* times one window of every
contender, in an order that rotates from round to round; the figure reported for a contender is
the median over rounds of its window time divided by the hand loop's in the same round, so that
machine noise hits both sides of each ratio alike. The Lightning Trainer cannot be called one
window at a time, so when it is installed the rounds run *inside* one ``trainer.fit``: a callback
at the end of every k-th batch (after Lightning's optimizer step) reads the time since the end of
the previous round (one window of Lightning's loop: data fetch, hooks, closure, backward, step,
zero) and then plays the other contenders' windows. Garbage collection is off while timing (as in
``timeit``); the first ``--warmup`` rounds are not counted.

Run: ``python bench/overhead.py [--quick] [--repeats 31] [--k 8] [--threads 1] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    add_json_option,
    add_round_options,
    available,
    markdown_table,
    quartiles,
    round_counts,
    write_json,
)
from torch import Tensor, nn

from accumopt import Accumulate

Batches = list[tuple[Tensor, Tensor]]
Window = Callable[[], None]
HAND = "hand loop"
ACCUMOPT_MODEL = "accumopt, model="
TRAINER = "Lightning Trainer"
LR = 1e-4


@dataclass
class Workload:
    """A model and the k micro-batches that one window trains it on."""

    name: str
    description: str
    model: nn.Module
    batches: Batches


def workloads(k: int) -> list[Workload]:
    """The three models: framework overhead dominates, many parameter tensors, compute-heavy."""
    torch.manual_seed(0)
    specs: list[tuple[str, str, nn.Module, int, int]] = [
        (
            "tiny MLP",
            "MLP 32-64-10, micro-batch 32 (framework overhead dominates)",
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
            32,
            32,
        ),
        (
            "100 tensors",
            "50 x Linear(16, 16), 100 parameter tensors, micro-batch 32",
            nn.Sequential(*[nn.Linear(16, 16) for _ in range(50)]),
            16,
            32,
        ),
        (
            "compute-heavy MLP",
            "MLP 512-2048-2048-10, micro-batch 64",
            nn.Sequential(
                nn.Linear(512, 2048),
                nn.ReLU(),
                nn.Linear(2048, 2048),
                nn.ReLU(),
                nn.Linear(2048, 10),
            ),
            512,
            64,
        ),
    ]
    out = []
    for name, description, model, width, micro in specs:
        width_out = model(torch.zeros(1, width)).shape[-1]
        batches = [(torch.randn(micro, width), torch.randn(micro, width_out)) for _ in range(k)]
        out.append(Workload(name, description, model, batches))
    return out


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The micro-batch's mean loss (the same for every contender)."""
    return F.mse_loss(model(x), y)


def hand_window(model: nn.Module, batches: Batches) -> Window:
    """The hand-written loop: ``(loss / k).backward()``, step and zero every k."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    k = len(batches)

    def window() -> None:
        for x, y in batches:
            (loss_of(model, x, y) / k).backward()
        opt.step()
        opt.zero_grad()

    return window


def accumopt_window(model: nn.Module, batches: Batches, *, given: bool = False) -> Window:
    """``Accumulate(SGD, every=k)``: backward, step and zero on every micro-batch; with
    ``given``, ``model=model`` too (backward passes counted at the model's outputs)."""
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=LR),
        every=len(batches),
        model=model if given else None,
    )

    def window() -> None:
        for x, y in batches:
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()

    return window


def accelerate_window(model: nn.Module, batches: Batches) -> Window:
    """Accelerate's documented accumulation loop on CPU."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(batches))
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))

    def window() -> None:
        for x, y in batches:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, x, y))
                opt.step()
                opt.zero_grad()

    return window


def fabric_window(model: nn.Module, batches: Batches) -> Window:
    """Lightning Fabric's documented accumulation loop (``no_backward_sync``, loss / k)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    k = len(batches)

    def window() -> None:
        for i, (x, y) in enumerate(batches):
            boundary = i == k - 1
            with fabric.no_backward_sync(model, enabled=not boundary):
                fabric.backward(loss_of(model, x, y) / k)
            if boundary:
                opt.step()
                opt.zero_grad()

    return window


def mbp_window(model: nn.Module, batches: Batches) -> Window:
    """mbp-pytorch: one decorated call on the k micro-batches as one batch, then step."""
    import mbp

    micro = len(batches[0][0])
    x_all = torch.cat([x for x, _ in batches])
    y_all = torch.cat([y for _, y in batches])
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    @mbp.apply(["x", "y"], ub_size=micro)
    def train_fn(x: Tensor, y: Tensor) -> Tensor:
        return loss_of(model, x, y)

    def window() -> None:
        train_fn(x=x_all, y=y_all)
        opt.step()
        opt.zero_grad()

    return window


#: contender -> (module it needs, or None, and the factory of its window).
CONTENDERS: dict[str, tuple[str | None, Callable[[nn.Module, Batches], Window]]] = {
    HAND: (None, hand_window),
    "accumopt": (None, accumopt_window),
    ACCUMOPT_MODEL: (None, functools.partial(accumopt_window, given=True)),
    "Accelerate": ("accelerate", accelerate_window),
    "Lightning Fabric": ("lightning", fabric_window),
    "mbp-pytorch": ("mbp", mbp_window),
}


@dataclass
class Rounds:
    """Plays rounds (one window per contender, rotating order) and keeps the counted times."""

    windows: dict[str, Window]
    warmup: int
    times: dict[str, list[float]] = field(default_factory=dict)
    played: int = 0

    def play(self, measured_outside: dict[str, float] | None = None) -> None:
        """Time one window of every contender; ``measured_outside`` adds times taken elsewhere
        in this round (the Lightning Trainer's window, timed inside ``fit``)."""
        names = list(self.windows)
        shift = self.played % len(names)
        times = dict(measured_outside or {})
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            self.windows[name]()
            times[name] = time.perf_counter() - start
        if self.played >= self.warmup:
            for name, seconds in times.items():
                self.times.setdefault(name, []).append(seconds)
        self.played += 1


def play_inside_trainer(model: nn.Module, batches: Batches, rounds: Rounds, total: int) -> None:
    """Fit ``model`` with ``Trainer(accumulate_grad_batches=k)`` for ``total`` optimizer steps,
    playing one round of the other contenders after each of Lightning's steps."""
    import lightning as L

    k = len(batches)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return loss_of(self.net, *batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class RoundAfterEachStep(L.Callback):
        start = 0.0

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(
            self,
            trainer: L.Trainer,
            pl_module: L.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            if (batch_idx + 1) % k == 0:  # Lightning has just stepped (it zeroes at window start)
                rounds.play({TRAINER: time.perf_counter() - self.start})
                self.start = time.perf_counter()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=k,
        max_steps=total,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[RoundAfterEachStep()],
    )
    trainer.fit(Module(), train_dataloaders=iter(batches * total))  # a list reads as many loaders
    if rounds.played != total:  # max_steps counts optimizer steps: this checks the accumulation
        raise RuntimeError(f"Lightning took {total} steps in {rounds.played} windows of {k}")


def measure(work: Workload, warmup: int, repeats: int, installed: set[str]) -> Rounds:
    """Play ``warmup + repeats`` rounds over the ``installed`` contenders on one workload."""
    windows = {
        name: factory(copy.deepcopy(work.model), work.batches)
        for name, (module, factory) in CONTENDERS.items()
        if module is None or module in installed
    }
    rounds = Rounds(windows, warmup)
    gc.collect()
    gc.disable()
    try:
        if "lightning" in installed:
            play_inside_trainer(copy.deepcopy(work.model), work.batches, rounds, warmup + repeats)
        else:
            for _ in range(warmup + repeats):
                rounds.play()
    finally:
        gc.enable()
    return rounds


def summarize(rounds: Rounds, order: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Per contender (``order``; default: hand loop, accumopt, then the peers that ran): median
    ms per window and the quartiles of its per-round ratio to the hand loop."""
    hand = rounds.times[HAND]
    if order is None:
        order = [name for name in [*CONTENDERS, TRAINER] if name in rounds.times]
    out = {}
    for name in order:
        seconds = rounds.times[name]
        q1, ratio, q3 = quartiles([t / h for t, h in zip(seconds, hand)])
        out[name] = {"ms": 1e3 * quartiles(seconds)[1], "ratio": ratio, "q1": q1, "q3": q3}
    return out


def tables(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: ratios to the hand loop (with their interquartile range over rounds), then
    median milliseconds per optimizer step; one row per contender, one column per model."""
    models = list(results)
    contenders = list(next(iter(results.values())))
    ratio_rows = [
        [name]
        + [
            "1" if name == HAND else f"{r['ratio']:.3f} ({r['q1']:.2f}-{r['q3']:.2f})"
            for r in (results[m][name] for m in models)
        ]
        for name in contenders
    ]
    ms_rows = [[name] + [f"{results[m][name]['ms']:.2f}" for m in models] for name in contenders]
    return (
        markdown_table(["ratio to hand loop (IQR)", *models], ratio_rows)
        + "\n\n"
        + markdown_table(["ms per optimizer step", *models], ms_rows)
    )


def quiet_peers(installed: set[str]) -> None:
    """Silence the installed peers' informational logging and their warnings about a single-CPU
    run (Lightning sets its loggers to INFO when imported, so import first; mbp's import turns on
    INFO logging at the root)."""
    for module in installed:
        importlib.import_module(module)
        warnings.filterwarnings("ignore", module=module)
    for name in ("accelerate", "lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every workload, print the table and return (and optionally save) the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_options(parser, "micro-steps")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_json_option(parser)
    args = parser.parse_args(argv)
    args.repeats, args.warmup = round_counts(args)
    torch.set_num_threads(args.threads)
    installed = {module for module in ("accelerate", "lightning", "mbp") if available(module)}
    quiet_peers(installed)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), k={args.k}, SGD, median of "
        f"{args.repeats} interleaved rounds after {args.warmup} warm-up rounds"
    )
    results, models = {}, {}
    for work in workloads(args.k):
        start = time.perf_counter()
        results[work.name] = summarize(measure(work, args.warmup, args.repeats, installed))
        models[work.name] = work.description
        print(f"  {work.name} ({work.description}): {time.perf_counter() - start:.1f} s")
    if torch.get_num_threads() != args.threads:
        raise RuntimeError(f"a peer changed torch's thread count to {torch.get_num_threads()}")
    markdown = tables(results)
    print(markdown)
    config = {"k": args.k, "threads": args.threads, "repeats": args.repeats, "warmup": args.warmup}
    data = {"config": config, "models": models, "results": results, "markdown": markdown}
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()

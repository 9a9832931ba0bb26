"""The models and the training loops that the timing benchmarks compare (public API only).

Every contender trains its own deep copy of the same model (accumopt's wrapper counts every
backward pass through its parameters, so contenders must not share parameters) on the same k
micro-batches per optimizer step, with plain SGD. One *window* is the k micro-steps and the
optimizer step; each factory below returns a function that runs one window.

- **hand loop**: ``(loss / k).backward()`` on every micro-batch, step and zero every k (at
  k = 1 plain ``loss.backward()``: nobody divides by one);
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
  it cannot be called one window at a time, so ``trainer.fit`` runs in its own thread and hands
  control back after every k-th batch (see :class:`TrainerWindows`);
- **mbp-pytorch**: one ``@mbp.apply(..., ub_size=micro)`` call on the k micro-batches as one batch
  of k * micro rows, then ``opt.step(); opt.zero_grad()``.

For ``MicroBatchRunner`` (one batch of k x m rows per optimizer step):

- **hand micro-batch loop**: for each slice of m rows, forward and ``(loss_sum / n).backward()``
  (n = k x m rows), then one ``step()`` and ``zero_grad()``;
- **runner, fixed m**: ``MicroBatchRunner(Accumulate(SGD, every_items=n, model=model),
  loss_fn, micro_batch_size=m)`` called once on the batch (``loss_fn`` returns the summed loss);
- **runner, auto (settled)**: ``micro_batch_size="auto"`` (start at the whole batch), first
  trained under ``simulate_oom(model, m)`` until its search settled at m; then the simulated
  limit is lifted and the parameters are reset, so the timed steps run at m with no OOM
  (``grow_after=None``: no growth probe above m while timing).
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner
from accumopt.testing import simulate_oom

Batches = list[tuple[Tensor, Tensor]]
Batch = tuple[Tensor, Tensor]
Window = Callable[[], Any]
HAND = "hand loop"
ACCUMOPT = "accumopt"
ACCUMOPT_MODEL = "accumopt, model="
ACCELERATE = "Accelerate"
FABRIC = "Lightning Fabric"
TRAINER = "Lightning Trainer"
MBP = "mbp-pytorch"
RUNNER_FIXED = "runner, fixed m"
RUNNER_AUTO = "runner, auto (settled)"
LR = 1e-4

TINY, HUNDRED, HEAVY = "tiny MLP", "100 tensors", "compute-heavy MLP"


@dataclass
class Workload:
    """A model and the k micro-batches that one window trains it on."""

    name: str
    description: str
    model: nn.Module
    batches: Batches


def linear_stack(tensors: int) -> nn.Sequential:
    """``tensors / 2`` x ``Linear(16, 16)``: many small parameter tensors, little compute."""
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(tensors // 2)])


def _spec(name: str) -> tuple[str, nn.Module, int, int]:
    """(description, model, input width, micro-batch rows) of the model called ``name``."""
    if name == TINY:
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        return "MLP 32-64-10, micro-batch 32 (framework overhead dominates)", model, 32, 32
    if name == HEAVY:
        model = nn.Sequential(
            nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
        )
        return "MLP 512-2048-2048-10, micro-batch 64", model, 512, 64
    if name.endswith(" tensors"):
        n = int(name.split()[0])
        description = f"{n // 2} x Linear(16, 16), {n} parameter tensors, micro-batch 32"
        return description, linear_stack(n), 16, 32
    raise ValueError(f"unknown model {name!r}")


def workload(name: str, k: int) -> Workload:
    """The model ``name`` ("tiny MLP", "N tensors", "compute-heavy MLP") and k micro-batches."""
    torch.manual_seed(0)
    description, model, width, micro = _spec(name)
    width_out = model(torch.zeros(1, width)).shape[-1]
    batches = [(torch.randn(micro, width), torch.randn(micro, width_out)) for _ in range(k)]
    return Workload(name, description, model, batches)


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The micro-batch's mean loss (the same for every contender)."""
    return F.mse_loss(model(x), y)


def sum_loss(net: nn.Module, batch: Batch) -> Tensor:
    """Summed squared error of a micro-batch (the runner weights it by its rows)."""
    x, y = batch
    return F.mse_loss(net(x), y, reduction="sum")


def hand_window(model: nn.Module, batches: Batches) -> Window:
    """The hand-written loop: ``(loss / k).backward()`` (plain ``loss.backward()`` at k = 1),
    step and zero every k."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    k = len(batches)

    def window() -> None:
        for x, y in batches:
            loss = loss_of(model, x, y)
            (loss / k if k > 1 else loss).backward()
        opt.step()
        opt.zero_grad()

    return window


def accumopt_window(
    model: nn.Module, batches: Batches, *, given: bool = False, **options: Any
) -> Window:
    """``Accumulate(SGD, every=k)``: backward, step and zero on every micro-batch; with
    ``given``, ``model=model`` too (backward passes counted at the model's outputs); other
    ``options`` go to ``Accumulate`` (``noise_scale=...``)."""
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=LR),
        every=len(batches),
        model=model if given else None,
        **options,
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


class _Stopped(Exception):
    """Raised inside the Trainer's fit thread to end a fit stopped before its last window."""


class TrainerWindows:
    """``Trainer(accumulate_grad_batches=k).fit`` in a thread of its own, one window per call.

    Calling the object lets the fit run one window (k batches: data fetch, hooks, closures,
    backward passes, one zeroing at the window's start, the optimizer step) and returns that
    window's (thread CPU ns, wall ns), measured inside the fit thread by a callback at the end of
    every k-th batch (right after Lightning's step), from the moment the thread resumed. The
    calling thread blocks meanwhile, so the two threads never run at once. The fit takes exactly
    ``windows`` optimizer steps (``max_steps``), which checks that Lightning accumulated k
    batches per step; :meth:`close` lets it finish.
    """

    def __init__(self, model: nn.Module, batches: Batches, windows: int) -> None:
        import lightning as L

        k = len(batches)
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._last: tuple[int, int] = (0, 0)
        self._error: BaseException | None = None
        self._stop = False
        self.windows = windows
        self.played = 0
        outer = self

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = model

            def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
                return loss_of(self.net, *batch)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=LR)

        class HandBack(L.Callback):
            cpu = wall = 0

            def resume(self) -> None:
                outer._go.acquire()
                if outer._stop:
                    raise _Stopped
                self.cpu, self.wall = time.thread_time_ns(), time.perf_counter_ns()

            def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                self.resume()

            def on_train_batch_end(
                self,
                trainer: L.Trainer,
                pl_module: L.LightningModule,
                outputs: Any,
                batch: Any,
                batch_idx: int,
            ) -> None:
                if (batch_idx + 1) % k == 0:  # Lightning has just stepped
                    cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
                    outer._last = (cpu - self.cpu, wall - self.wall)
                    outer._done.release()
                    self.resume()

        self._trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            accumulate_grad_batches=k,
            max_steps=windows,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[HandBack()],
        )
        threads = torch.get_num_threads()

        def fit() -> None:
            torch.set_num_threads(threads)  # a new thread does not inherit the setting
            try:  # a list would read as many loaders: give one iterator
                self._trainer.fit(Module(), train_dataloaders=iter(batches * windows))
            except _Stopped:
                pass
            except BaseException as err:  # handed to the caller
                self._error = err
            finally:
                self._done.release()

        self._thread = threading.Thread(target=fit, name="lightning-fit", daemon=True)
        self._thread.start()

    def __call__(self) -> tuple[int, int]:
        """Run one window of the fit; its (thread CPU ns, wall ns)."""
        if self.played >= self.windows:
            raise RuntimeError(f"the fit was planned for {self.windows} windows")
        self._go.release()
        self._done.acquire()
        if self._error is not None:
            raise RuntimeError("Lightning's fit failed") from self._error
        self.played += 1
        return self._last

    def close(self) -> None:
        """Let the fit finish (stop it when fewer windows were played than planned) and check
        that it took one optimizer step per window."""
        self._stop = self.played < self.windows
        self._go.release()
        self._thread.join(timeout=60)
        if self._error is not None:
            raise RuntimeError("Lightning's fit failed") from self._error
        if self.played == self.windows and self._trainer.global_step != self.windows:
            raise RuntimeError(
                f"Lightning took {self._trainer.global_step} steps in {self.windows} windows"
            )


#: contender -> the peer module it needs (None: accumopt only).
CONTENDERS: dict[str, str | None] = {
    ACCUMOPT: None,
    ACCUMOPT_MODEL: None,
    ACCELERATE: "accelerate",
    FABRIC: "lightning",
    TRAINER: "lightning",
    MBP: "mbp",
}
_FACTORIES: dict[str, Callable[[nn.Module, Batches], Window]] = {
    ACCUMOPT: accumopt_window,
    ACCUMOPT_MODEL: functools.partial(accumopt_window, given=True),
    ACCELERATE: accelerate_window,
    FABRIC: fabric_window,
    MBP: mbp_window,
}


def contender_window(name: str, model: nn.Module, batches: Batches, windows: int) -> Window:
    """The window of contender ``name`` on ``model``; ``windows``: how many will be played (the
    Trainer's fit is planned for exactly that many; call its ``close()`` at the end)."""
    if name == TRAINER:
        return TrainerWindows(model, batches, windows)
    return _FACTORIES[name](model, batches)


def quiet_peers(installed: set[str]) -> None:
    """Silence the installed peers' informational logging and their warnings about a single-CPU
    run (Lightning sets its loggers to INFO when imported, so import first; mbp's import turns on
    INFO logging at the root)."""
    for module in installed:
        importlib.import_module(module)
        warnings.filterwarnings("ignore", module=module)
    for name in ("accelerate", "lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.WARNING)


# --- MicroBatchRunner ---------------------------------------------------------------------


@dataclass
class Settled:
    """Where the runner's search ended: the steady micro-batch size and the batches it took."""

    size: int
    batches: int
    settled: bool


def settle(runner: MicroBatchRunner, batch: Any, sizes: list[int], max_batches: int) -> Settled:
    """Feed ``batch`` to ``runner`` until a batch runs without OOM and starts at the same size as
    the previous batch (the last micro-batch of a batch is whatever rows are left, so the size
    is read from each batch's first attempt).

    Args:
        runner: a ``MicroBatchRunner`` with ``micro_batch_size="auto"``.
        batch: the batch fed on every call.
        sizes: the list a forward hook appends every attempt's row count to
            (``simulate_oom``'s ``record.sizes``).
        max_batches: give up after this many batches (``settled`` is then False).
    """
    previous = None
    for count in range(1, max_batches + 1):
        start, ooms = len(sizes), runner.ooms
        runner(batch)
        first = sizes[start]
        if runner.ooms == ooms and first == previous:
            return Settled(first, count, True)
        previous = first
    return Settled(sizes[start], max_batches, False)


def whole_batch(work: Workload) -> tuple[Batch, int]:
    """The window's k micro-batches as one batch of k x m rows, and m."""
    x = torch.cat([x for x, _ in work.batches])
    y = torch.cat([y for _, y in work.batches])
    return (x, y), len(work.batches[0][0])


def hand_micro_window(model: nn.Module, batch: Batch, micro: int) -> Window:
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
    """A runner over ``Accumulate(SGD, every_items=n, model=model)`` (counted at the model's
    outputs, the documented setting): fixed ``micro`` rows, or "auto" with ``grow_after=None``
    (no probe above the settled size after 1000 clean micro-batches: the timed steps must all
    run at the size it settled on)."""
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every_items=n, model=model)
    if micro is None:
        return MicroBatchRunner(
            opt,
            lambda b: sum_loss(model, b),
            micro_batch_size="auto",
            grow_after=None,
            loss_reduction="sum",
        )
    return MicroBatchRunner(
        opt, lambda b: sum_loss(model, b), micro_batch_size=micro, loss_reduction="sum"
    )


def runner_fixed_window(model: nn.Module, batch: Batch, micro: int) -> Window:
    """One runner call per step, at a fixed micro-batch size."""
    runner = make_runner(model, len(batch[0]), micro)

    def window() -> None:
        runner(batch)

    return window


def runner_auto_window(model: nn.Module, batch: Batch, micro: int) -> Window:
    """One runner call per step with ``"auto"``, after its search settled at ``micro`` rows under
    a simulated limit (then lifted, and the parameters reset to where they started)."""
    start = copy.deepcopy(model.state_dict())
    runner = make_runner(model, len(batch[0]), None)
    level = logging.getLogger("accumopt").level
    logging.getLogger("accumopt").setLevel(logging.ERROR)  # the settling OOMs, one line each
    try:
        with simulate_oom(model, micro) as record:
            found = settle(runner, batch, record.sizes, max_batches=20)
    finally:
        logging.getLogger("accumopt").setLevel(level)
    if not found.settled or found.size != micro:
        raise RuntimeError(f"the search settled at {found} instead of {micro} rows")
    model.load_state_dict(start)
    changes = len(runner.history)

    def window() -> None:
        runner(batch)
        if len(runner.history) != changes:
            raise RuntimeError(f"the settled size changed while timing: {runner.history}")

    return window


RUNNERS: dict[str, Callable[[nn.Module, Batch, int], Window]] = {
    RUNNER_FIXED: runner_fixed_window,
    RUNNER_AUTO: runner_auto_window,
}


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the parameters of two copies of a model."""
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))

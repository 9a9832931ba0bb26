"""Lightning (accumopt.integrations.lightning): automatic and manual optimization, DDP.

Every exactness claim is float64 SGD against the same LightningModule trained without
accumulation (plain SGD) at the full effective batch: rel = ||theta - theta_full|| /
||theta_full - theta_0|| <= 1e-12. The data give a ragged last micro-batch and a short last
window: 20 rows in micro-batches of 3 (the last of 2), windows of 3 micro-batches, so the
full-batch run sees batches of 9, 9 and 2 per epoch. The DDP tests run Lightning's own
``ddp_fork`` strategy: 2 forked CPU processes on gloo (about 1 s each: nothing to import).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason='not installed: pip install "accumopt[lightning]"')

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from accumopt import Accumulate
from accumopt.integrations.lightning import AccumulateCallback, loss_over_items

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),  # Lightning on torch 2.13
]
ROWS, MICRO, EVERY, LR, EPOCHS = 20, 3, 3, 0.1, 2
FULL = MICRO * EVERY  # the effective batch: 9 rows
UPDATES = 2 * 3  # per epoch: windows of 9, 9 and 2 rows


class Net(L.LightningModule):
    """A small MLP; ``every=None`` trains without accumulation (the reference)."""

    def __init__(
        self,
        every: int | None = None,
        every_items: float | None = None,
        manual: bool = False,
        weighted: bool = True,
        schedule: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
        )
        self.every, self.every_items, self.weighted = every, every_items, weighted
        self.schedule = schedule
        self.automatic_optimization = not manual
        self.seen: list[float] = []  # the gradient norm each on_before_optimizer_step sees
        self.lrs: list[float] = []
        self.extra_steps = 0  # manual: further opt.step() calls in each training_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss_sum = F.mse_loss(self.net(x), y, reduction="sum")
        if self.automatic_optimization or self.every_items is None:
            loss = loss_over_items(self, loss_sum, len(y)) if self.weighted else loss_sum / len(y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        if self.every_items is not None:  # next_items through Lightning's optimizer wrapper
            opt.next_items(len(y))  # type: ignore[union-attr]
            loss = loss_sum
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        opt.zero_grad()  # type: ignore[union-attr]
        for _ in range(self.extra_steps):
            again = F.mse_loss(self.net(x), y, reduction="sum")
            self.manual_backward(loss_over_items(self, again, len(y)))
            opt.step()  # type: ignore[union-attr]
        if self.schedule is not None and getattr(opt, "did_update", True):
            self.lr_schedulers().step()  # type: ignore[union-attr]
        return None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad.flatten() for p in self.parameters() if p.grad is not None]
        self.seen.append(torch.cat(grads).norm().item())
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        if self.every is not None or self.every_items is not None:
            opt = Accumulate(opt, every=self.every, every_items=self.every_items)
        if self.schedule is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, **self.schedule}}


def data(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 3, generator=g)


def quiet_trainer(callbacks: list[Any] | None, **kwargs: Any) -> L.Trainer:
    """A CPU Trainer without progress bar, logger or model summary (nor checkpointing, unless
    ``enable_checkpointing=True``)."""
    return L.Trainer(
        accelerator="cpu",
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **{"enable_checkpointing": False, **kwargs},
    )


def fit(
    module: Net,
    batch_size: int,
    rows: int = ROWS,
    callbacks: list[Any] | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    trainer = quiet_trainer(callbacks, **{"max_epochs": EPOCHS, **trainer_kwargs})
    x, y = data(rows)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=batch_size))
    return trainer


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def rel(module: torch.nn.Module, reference: torch.nn.Module) -> float:
    start = flat(type(reference)())  # the same initial parameters (seeded)
    return ((flat(module) - flat(reference)).norm() / (flat(reference) - start).norm()).item()


def run_pair(
    accumulated: Net, reference: Net, rows: int = ROWS, **trainer_kwargs: Any
) -> tuple[L.Trainer, L.Trainer]:
    ours = fit(accumulated, MICRO, rows, [AccumulateCallback()], **trainer_kwargs)
    full = fit(reference, FULL, rows, **trainer_kwargs)
    return ours, full


# ---------------------------------------------------------------------- exactness


@pytest.mark.parametrize("weighted", [True, False], ids=["items", "mean_losses"])
def test_lightning_automatic_optimization_exact_with_ragged_batch_and_short_last_window(
    weighted: bool,
) -> None:
    rows = ROWS if weighted else 18  # plain mean losses are exact for equal micro-batches
    ours, full = run_pair(Net(every=EVERY, weighted=weighted), Net(), rows)
    updates = UPDATES if weighted else 2 * 2
    assert rel(ours.lightning_module, full.lightning_module) <= 1e-12
    assert ours.global_step == full.global_step == updates
    assert ours.optimizers[0].updates == updates  # type: ignore[attr-defined]
    assert ours.fit_loop.epoch_loop._batches_that_stepped == updates  # the logging step
    seen, expected = ours.lightning_module.seen, full.lightning_module.seen
    assert len(seen) == updates  # on_before_optimizer_step at real updates only
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(expected), rtol=1e-12, atol=0)


class Cached(Net):
    """``configure_optimizers`` returns the wrapper it built at the first fit at every fit."""

    def configure_optimizers(self) -> Any:
        if "built" not in self.__dict__:
            self.built = super().configure_optimizers()
        return self.built


class FailsOnce(Net):
    """``training_step`` raises at batch ``at`` (inside a window) of the first fit only."""

    def __init__(self, at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at, self.failed = at, False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.at and not self.failed:
            self.failed = True
            raise KeyError("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.parametrize("module_cls", [Net, Cached])
@pytest.mark.parametrize("one_callback", [False, True])
def test_lightning_two_fits_of_one_module_train_on_exactly(
    module_cls: type[Net], manual: bool, one_callback: bool
) -> None:
    """At a fit's end the callback stops its wrappers counting the module's passes (they
    used to count the next fit's passes too, which then stopped with an error): two fits of
    one epoch, with the new wrapper configure_optimizers returns or the same one returned
    again, and a new or the same callback, equal one fit of two epochs."""
    module = module_cls(every=EVERY, manual=manual)
    callback = AccumulateCallback()
    fit(module, MICRO, callbacks=[callback], max_epochs=1)
    fit(module, MICRO, callbacks=[callback if one_callback else AccumulateCallback()], max_epochs=1)
    both = Net(every=EVERY, manual=manual)
    fit(both, MICRO, callbacks=[AccumulateCallback()], max_epochs=2)
    assert rel(module, both) <= 1e-12


def test_lightning_a_fit_after_a_failed_one_trains_on_exactly() -> None:
    """A training_step that raises inside a window ends the fit; the module fit again (a new
    wrapper) trains as a fresh module given its state_dict would: the failed fit's wrapper
    counts none of its passes, and its window's gradient in .grad is not carried over."""
    module = FailsOnce(at=4, every=EVERY)
    with pytest.raises(KeyError, match="boom"):
        fit(module, MICRO, callbacks=[AccumulateCallback()], max_epochs=1)
    assert module.net[0].weight.grad is not None  # the failed window's sum is in .grad
    fresh = Net(every=EVERY)
    fresh.load_state_dict(module.state_dict())
    fit(module, MICRO, callbacks=[AccumulateCallback()], max_epochs=1)
    fit(fresh, MICRO, callbacks=[AccumulateCallback()], max_epochs=1)
    assert torch.equal(flat(module), flat(fresh))


class CachedFailsOnce(FailsOnce, Cached):
    """Raises at batch ``at`` of the first fit; the same wrapper is returned at every fit."""


def sgd_windows(windows: list[list[int]], rows: int = ROWS, clip: float | None = None) -> Net:
    """Plain SGD, one update per window of batch indices (batches of MICRO rows): the mean
    loss over the window's rows (its gradient clipped to the 2-norm ``clip``)."""
    x, y = data(rows)
    reference = Net()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for window in windows:
        idx = [i for b in window for i in range(MICRO * b, min(MICRO * b + MICRO, rows))]
        opt.zero_grad()
        F.mse_loss(reference.net(x[idx]), y[idx], reduction="sum").div(len(idx)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        opt.step()
    return reference


def test_lightning_the_same_wrapper_after_a_failed_fit_goes_on_with_its_window() -> None:
    """The failed fit leaves a window of batch 3 open in .grad; Lightning zeroes the gradients
    at the next fit's start, after on_fit_start, so the callback moves the window into the
    wrapper's buffer first (it was wiped before, and the window's close refused)."""
    module = CachedFailsOnce(at=4, every=EVERY)
    with pytest.raises(KeyError, match="boom"):
        fit(module, MICRO, callbacks=[AccumulateCallback()], max_epochs=1)
    assert module.built.micro_step == 1
    fit(module, MICRO, callbacks=[AccumulateCallback()], max_epochs=1)
    assert rel(module, sgd_windows([[0, 1, 2], [3, 0, 1], [2, 3, 4], [5, 6]])) <= 1e-12


def test_lightning_resume_from_a_checkpoint_saved_inside_a_window_is_exact(
    tmp_path: Path,
) -> None:
    """OnExceptionCheckpoint saves the window of batch 3 when batch 4 raises; a fresh module
    resumed from it keeps that window: Lightning restores the optimizer after on_fit_start
    and then zeroes the gradients, so the callback moves a restored window into the buffer
    from a load_state_dict post hook (its gradient was lost before, its rows still divided
    by). Lightning feeds the resumed epoch from the loader's first batch (batch_idx goes on
    at 4): the reference replays the batches it fed."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    fed: list[int] = []

    class Logs(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            fed.append(int(batch[0][0, 0].item() * 1e6))  # which batch of the loader it is
            return super().training_step(batch, batch_idx)

    def trainer(*callbacks: Any) -> L.Trainer:
        every = [AccumulateCallback(), *callbacks]
        return quiet_trainer(
            every, enable_checkpointing=True, default_root_dir=tmp_path, max_epochs=EPOCHS
        )

    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO)
    with pytest.raises(KeyError, match="boom"):
        trainer(OnExceptionCheckpoint(tmp_path)).fit(FailsOnce(at=4, every=EVERY), loader)
    resumed = Logs(every=EVERY)
    trainer().fit(resumed, loader, ckpt_path=tmp_path / "on_exception.ckpt")
    firsts = [int(x[MICRO * b, 0].item() * 1e6) for b in range(7)]
    batches = [firsts.index(f) for f in fed]
    assert len(batches) == 3 + 7  # the resumed epoch's batch_idx 4-6, then a whole epoch
    windows = [[0, 1, 2], [3, *batches[:2]], [batches[2]], [0, 1, 2], [3, 4, 5], [6]]
    assert rel(resumed, sgd_windows(windows)) <= 1e-12


def test_lightning_a_wrapper_stepped_after_its_fit_says_it_was_released() -> None:
    module = Net(every=EVERY)
    opt = fit(module, MICRO, callbacks=[AccumulateCallback()], max_epochs=1).optimizers[0]
    x, y = data()
    F.mse_loss(module.net(x), y).backward()
    before = flat(module)
    with pytest.raises(RuntimeError, match=r"was released \(opt.release\(\), at the end of a fit"):
        opt.step()
    assert torch.equal(flat(module), before)


class Skips(Net):
    """``training_step`` returns None (Lightning skips the batch) for the batches in ``skip``."""

    def __init__(self, skip: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.skip = skip

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx in self.skip else super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("skip", "every"), [(6, 3), (6, 2), (5, 2), (3, 3)])
def test_lightning_training_step_returning_none_skips_the_batch_exactly(
    skip: int, every: int
) -> None:
    """A skipped batch adds nothing to the window; the epoch's last batch skipped with the
    window empty used to crash ("no backward pass since the last step()"; found by review)."""
    module = Skips({skip}, every=every)
    fit(module, MICRO, callbacks=[AccumulateCallback()], max_epochs=1)
    x, y = data()
    kept = [i for b in range(7) if b != skip for i in range(3 * b, min(3 * b + 3, ROWS))]
    windows = [kept[i : i + every * MICRO] for i in range(0, len(kept), every * MICRO)]
    reference = Net()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for rows in windows:
        opt.zero_grad()
        F.mse_loss(reference.net(x[rows]), y[rows], reduction="sum").div(len(rows)).backward()
        opt.step()
    assert rel(module, reference) < 1e-12


@pytest.mark.parametrize("window", ["every", "every_items"])
def test_lightning_manual_optimization_exact_with_ragged_batch_and_short_last_window(
    window: str,
) -> None:
    kwargs = {"every": EVERY} if window == "every" else {"every_items": float(FULL)}
    ours, full = run_pair(Net(manual=True, **kwargs), Net(manual=True))  # type: ignore[arg-type]
    assert rel(ours.lightning_module, full.lightning_module) <= 1e-12
    assert ours.global_step == full.global_step == UPDATES
    seen, expected = ours.lightning_module.seen, full.lightning_module.seen
    assert len(seen) == UPDATES
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(expected), rtol=1e-12, atol=0)


class ThroughTheProxy(Net):
    """Manual optimization that uses the wrapper only through ``self.optimizers()`` (Lightning's
    proxy): a setter at the first batch, read-outs compared with the wrapper's own at every
    batch, an update hook, and ``flush()`` after batch 4 (windows [0, 1, 2], [3, 4], [5, 6])."""

    def __init__(self) -> None:
        super().__init__(every=EVERY, manual=True)
        self.reports: list[Any] = []
        self.mismatches: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt, acc = self.optimizers(), self.optimizers(use_pl_optimizer=False)
        if batch_idx == 0:
            opt.max_grad_norm = 0.05  # type: ignore[union-attr]
            opt.register_update_hook(lambda _, report: self.reports.append(report))  # type: ignore[union-attr]
        super().training_step(batch, batch_idx)
        names = ("micro_step", "updates", "will_update", "phase", "every", "items", "weighted")
        names += ("last_window", "did_update", "rollback", "world_size", "rank", "max_grad_norm")
        self.mismatches += [n for n in names if getattr(opt, n) != getattr(acc, n)]
        opt.check_usable()  # type: ignore[union-attr]
        assert "accumopt" in opt.state_dict()["param_groups"][0]  # type: ignore[union-attr]
        if batch_idx == 4:
            assert opt.flush() and opt.micro_step == 0  # type: ignore[union-attr]


def test_lightning_every_wrapper_method_and_read_out_works_through_self_optimizers() -> None:
    """``self.optimizers()`` is Lightning's proxy, whose class subclasses the wrapper's: a
    wrapper method reached through it ran with the proxy as ``self`` (``flush()`` reported an
    interruption that never happened; a setter such as ``max_grad_norm`` landed on the proxy
    and never clipped). Every read and write now reaches the wrapper, and ``flush()`` is a
    Lightning optimizer step (counted in global_step, hooks run)."""
    module = ThroughTheProxy()
    trainer = fit(module, MICRO, callbacks=[AccumulateCallback()], max_epochs=1)
    assert module.mismatches == []
    assert [r.micro_steps for r in module.reports] == [3, 2, 2]
    assert all(r.grad_norm is not None for r in module.reports)  # clipped by max_grad_norm
    assert trainer.global_step == 3 and len(module.seen) == 3
    assert rel(module, sgd_windows([[0, 1, 2], [3, 4], [5, 6]], clip=0.05)) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lightning_bf16_mixed_with_gradient_clip_val_is_exact(dtype: torch.dtype) -> None:
    """``precision="bf16-mixed"`` with ``gradient_clip_val`` stopped at the first boundary
    with Lightning's "does not allow for gradient clipping because it performs unscaling of
    gradients internally ... fused optimizer?": Lightning's MixedPrecision refuses to clip for
    any optimizer whose step() takes GradScaler's arguments (``_step_supports_amp_scaling``,
    which Accumulate declares for per-micro-step GradScaler loops), though bf16 has no scaler
    and the window's gradient in .grad is plain. The callback clips through Lightning's plain
    clipping during the fit. float64 (autocast leaves it alone): equal to Lightning's
    full-batch step; float32 (bf16 matmuls): equal to a hand loop of the same micro-batches
    under the same autocast, summed, divided, clipped. Both include the flushed short window."""
    torch.set_default_dtype(dtype)
    kwargs = {"precision": "bf16-mixed", "gradient_clip_val": 0.05}
    ours, full = run_pair(Net(every=EVERY), Net(), **kwargs)
    assert ours.global_step == UPDATES
    if dtype == torch.float64:
        assert rel(full.lightning_module, fit(Net(), FULL).lightning_module) > 1e-2  # clips
        assert rel(ours.lightning_module, full.lightning_module) <= 1e-12
        return
    reference, (x, y) = Net(), data()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for window in [[0, 1, 2], [3, 4, 5], [6]] * EPOCHS:
        opt.zero_grad()
        for b in window:
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                loss = F.mse_loss(
                    reference.net(x[3 * b : 3 * b + 3]), y[3 * b : 3 * b + 3], reduction="sum"
                )
            loss.backward()
        for p in reference.parameters():
            p.grad.div_(len(x[3 * window[0] : 3 * window[-1] + 3]))  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        opt.step()
    assert rel(ours.lightning_module, reference) <= 1e-6


def test_lightning_16_mixed_is_refused_at_setup() -> None:
    """With a GradScaler Lightning unscales only in its own optimizer step, and treats the
    wrapper as an optimizer that unscales itself: the windows would be applied wrongly (the
    flushed one in scaled units). Refused before anything runs (16-mixed on CPU has no scaler
    in Lightning: the plugin is given one here)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*Expected 'bf16-mixed'"):
        fit(Net(every=EVERY), MICRO, callbacks=[AccumulateCallback()], plugins=[plugin])


class ScheduleFreeLike(torch.optim.SGD):
    """The train()/eval() contract of schedule-free optimizers (``schedulefree.SGDScheduleFree``,
    whose mode lives in the param groups): ``eval()`` moves the parameters to the evaluation
    point (here: halves them, exactly undone), ``train()`` moves them back, and ``step()``
    refuses outside train mode."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.calls: list[str] = []
        for group in self.param_groups:
            group["train_mode"] = False

    @torch.no_grad()
    def _mode(self, train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] != train:
                for p in group["params"]:
                    p.mul_(2.0 if train else 0.5)
            group["train_mode"] = train
        self.calls.append("train" if train else "eval")

    def train(self) -> None:
        self._mode(True)

    def eval(self) -> None:
        self._mode(False)

    def step(self, closure: Any = None) -> Any:
        assert self.param_groups[0]["train_mode"], "stepped in eval mode"
        return super().step(closure)


class ScheduleFree(Net):
    """The schedule-free recipe: ``optimizers().train()`` for training, ``.eval()`` around
    validation and at the epoch's end."""

    def configure_optimizers(self) -> Any:
        opt = ScheduleFreeLike(self.parameters(), lr=LR)  # starts in eval mode, unmoved
        return opt if self.every is None else Accumulate(opt, every=self.every)

    def on_train_epoch_start(self) -> None:
        self.optimizers().train()  # type: ignore[union-attr]

    def on_validation_epoch_start(self) -> None:
        self.optimizers().eval()  # type: ignore[union-attr]

    def on_validation_epoch_end(self) -> None:
        self.optimizers().train()  # type: ignore[union-attr]

    def on_train_epoch_end(self) -> None:
        self.optimizers().eval()  # type: ignore[union-attr]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        return None


def test_lightning_schedule_free_optimizer_train_and_eval_reach_it_and_stay_exact() -> None:
    """``Accumulate.train()/eval()`` forward to the inner optimizer, also through Lightning's
    proxy; validation in the middle of a window (val_check_interval=4) moves the parameters
    and back without touching the window."""
    x, y = data()
    val = DataLoader(TensorDataset(x, y), batch_size=5)
    ours, full = ScheduleFree(every=EVERY), ScheduleFree()
    trainer = quiet_trainer([AccumulateCallback()], max_epochs=EPOCHS, val_check_interval=4)
    trainer.fit(ours, DataLoader(TensorDataset(x, y), batch_size=MICRO), val)
    quiet_trainer(None, max_epochs=EPOCHS).fit(full, DataLoader(TensorDataset(x, y), FULL))
    inner = trainer.optimizers[0].optimizer  # type: ignore[attr-defined]
    assert inner.calls.count("eval") == 1 + 2 * EPOCHS  # sanity check, each epoch: 1 + end
    assert trainer.global_step == UPDATES
    assert rel(ours, full) <= 1e-12


class TwoNets(Net):
    """Manual optimization of two independent MLPs, each with its own optimizer and loss (the
    shape of a GAN's loop): every training_step steps both."""

    def __init__(self, every: int | None = None) -> None:
        super().__init__(every=every, manual=True)
        self.other = torch.nn.Linear(4, 3)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for opt, net in zip(self.optimizers(), (self.net, self.other)):  # type: ignore[arg-type]
            loss_sum = F.mse_loss(net(x), y, reduction="sum")
            self.manual_backward(loss_over_items(self, loss_sum, len(y), optimizer=opt))
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> Any:
        opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (self.net, self.other)]
        return opts if self.every is None else [Accumulate(o, every=self.every) for o in opts]


def test_lightning_manual_optimization_two_optimizers_exact() -> None:
    ours, full = run_pair(TwoNets(every=EVERY), TwoNets())
    assert rel(ours.lightning_module, full.lightning_module) <= 1e-12
    assert [o.updates for o in ours.optimizers] == [UPDATES, UPDATES]  # type: ignore[attr-defined]
    assert ours.global_step == full.global_step == 2 * UPDATES  # Lightning counts both


@pytest.mark.parametrize(("algorithm", "clip"), [("norm", 0.5), ("value", 0.05)])
def test_lightning_automatic_gradient_clip_val_clips_the_window_mean_once(
    algorithm: str, clip: float
) -> None:
    kwargs = {"gradient_clip_val": clip, "gradient_clip_algorithm": algorithm}
    ours, full = run_pair(Net(every=EVERY), Net(), **kwargs)
    unclipped = fit(Net(), FULL)
    assert rel(full.lightning_module, unclipped.lightning_module) > 1e-2  # clipping bites
    assert rel(ours.lightning_module, full.lightning_module) <= 1e-12


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_lightning_step_scheduler_and_max_steps_count_real_updates(manual: bool) -> None:
    schedule = {"interval": "step"}
    ours, full = run_pair(
        Net(every=EVERY, manual=manual, schedule=schedule),
        Net(manual=manual, schedule=schedule),
        max_steps=5,  # stops inside the second epoch, after its second update
        max_epochs=-1,
    )
    assert ours.global_step == full.global_step == 5
    assert rel(ours.lightning_module, full.lightning_module) <= 1e-12
    assert ours.lightning_module.lrs == pytest.approx(full.lightning_module.lrs, rel=1e-15)
    assert len(ours.lightning_module.lrs) == 5
    assert ours.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.7**5)


def test_lightning_example_digits_first_window_matches_full_batch() -> None:
    path = Path(__file__).resolve().parent.parent / "examples" / "lightning_digits.py"
    spec = importlib.util.spec_from_file_location("example_lightning_digits", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    threads = torch.get_num_threads()
    torch.set_default_dtype(torch.float32)  # as a user runs it (the fixture restores it)
    try:
        spec.loader.exec_module(module)
        out = module.main(["--epochs", "2"])
    finally:
        torch.set_num_threads(threads)
    assert out["first_window_rel"] <= 1e-12
    assert out["updates"] == out["global_step"] == 2 * 3  # 1437 rows: windows 512, 512, 413
    assert out["test_accuracy"] > 0.3


# ---------------------------------------------------------------------- loud errors


def test_lightning_accumulate_grad_batches_with_accumulate_raises() -> None:
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\).*1/2 of the right"):
        fit(Net(every=EVERY), MICRO, callbacks=[AccumulateCallback()], accumulate_grad_batches=2)


def test_lightning_own_accumulation_without_the_callback_is_refused_before_any_update() -> None:
    """Without AccumulateCallback nothing of the integration runs: the core sees Lightning's
    accumulate_grad_batches in the closure Lightning steps with (its loss division would make
    every update 1/2 of the right size) and refuses before anything is applied."""
    module = Net(every=EVERY, weighted=False)  # a mean loss: no helper of the integration
    before = flat(module)
    with pytest.raises(RuntimeError, match=r"accumulate_grad_batches > 1 accumulates"):
        fit(module, MICRO, accumulate_grad_batches=2)
    assert torch.equal(flat(module), before)


def test_lightning_gradient_accumulation_scheduler_raises_when_it_turns_on() -> None:
    module = Net(every=EVERY)
    callbacks = [AccumulateCallback(), GradientAccumulationScheduler({1: 2})]
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2"):
        fit(module, MICRO, callbacks=callbacks)
    assert module.trainer.current_epoch == 1  # the first epoch ran, nothing after the change


def test_lightning_every_items_in_automatic_optimization_raises() -> None:
    with pytest.raises(ValueError, match=r"every_items=9\) in automatic optimization"):
        fit(Net(every_items=9.0), MICRO, callbacks=[AccumulateCallback()])


def test_lightning_step_scheduler_with_frequency_raises() -> None:
    module = Net(every=EVERY, schedule={"interval": "step", "frequency": 2})
    with pytest.raises(ValueError, match=r"frequency=2.*counts micro-batches"):
        fit(module, MICRO, callbacks=[AccumulateCallback()])


def test_lightning_callback_without_accumulate_raises() -> None:
    with pytest.raises(ValueError, match=r"no Accumulate optimizer \(got \['SGD'\]\)"):
        fit(Net(), MICRO, callbacks=[AccumulateCallback()])


@pytest.mark.parametrize("manual", [False, True])
def test_lightning_accumulate_without_the_callback_is_refused_at_the_first_step(
    manual: bool,
) -> None:
    """Without the callback, Lightning stepped the wrapper every batch: global_step and
    max_steps counted micro-batches and windows ran across epochs, with only a warning at exit
    (found by a fresh-eyes run). Refused at the first step, nothing applied."""
    module = Net(every=EVERY, weighted=False, manual=manual)
    before = flat(module)
    with pytest.raises(RuntimeError, match=r"without accumopt's AccumulateCallback"):
        fit(module, MICRO)
    assert torch.equal(flat(module), before)


def test_lightning_clipping_without_the_callback_is_refused_before_the_update() -> None:
    """Without AccumulateCallback, Lightning would clip each micro-step's partial sum: the
    missing callback is refused at the first step, the parameters untouched. Lightning's own
    accumulation without the callback is refused by the core too
    (test_lightning_own_accumulation_without_the_callback_...)."""
    module = Net(every=EVERY, weighted=False)
    before = flat(module)
    with pytest.raises(RuntimeError, match="without accumopt's AccumulateCallback"):
        fit(module, MICRO, gradient_clip_val=0.01)
    assert torch.equal(flat(module), before)


def test_lightning_strategy_that_accumulates_itself_raises() -> None:
    class SelfAccumulating(SingleDeviceStrategy):
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    with pytest.raises(ValueError, match=r"SelfAccumulating accumulates gradients itself"):
        fit(
            Net(every=EVERY),
            MICRO,
            callbacks=[AccumulateCallback()],
            strategy=SelfAccumulating(device="cpu"),
        )


def test_lightning_manual_second_step_in_the_last_batch_raises() -> None:
    module = Net(every=EVERY, manual=True)
    module.extra_steps = 1  # two micro-steps per training_step
    with pytest.raises(RuntimeError, match=r"opt.step\(\) was called again in the epoch's last"):
        fit(module, MICRO, callbacks=[AccumulateCallback()])


# ---------------------------------------------------------------------- DDP, 2 gloo ranks


class _Report(L.Callback):
    """On each rank: counts every all-reduce of the whole gradient (DDP's bucket, through a
    comm hook, and accumopt's own boundary all-reduce), and DDP's alone; at the end, reports through
    ``callback_metrics`` (what ``ddp_fork`` sends back from rank 0) the count, the step
    counts and how far the ranks' parameters are apart."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        self.syncs, self.real, size = 0, dist.all_reduce, len(flat(pl_module))

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.syncs += tensor.numel() == size
            return self.real(tensor, *args, **kwargs)

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
            self.ddp_syncs += 1
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / 2)

        self.ddp_syncs, dist.all_reduce = 0, all_reduce
        trainer.strategy.model.register_comm_hook(None, hook)  # type: ignore[union-attr]

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        dist.all_reduce = self.real
        params = [flat(pl_module), flat(pl_module)]
        dist.all_gather(params, flat(pl_module))
        opt = trainer.optimizers[0]
        trainer.callback_metrics.update(
            grad_syncs=torch.tensor(self.syncs),
            ddp_syncs=torch.tensor(self.ddp_syncs),
            global_step=torch.tensor(trainer.global_step),
            updates=torch.tensor(getattr(opt, "updates", -1)),
            ranks_apart=(params[0] - params[1]).norm(),
        )


def ddp_fork_trainer(epochs: int, *callbacks: Any, **kwargs: Any) -> L.Trainer:
    """A Trainer on 2 forked CPU ranks with ``AccumulateCallback`` and ``callbacks``."""
    every = [AccumulateCallback(), *callbacks]
    return quiet_trainer(every, devices=2, strategy="ddp_fork", max_epochs=epochs, **kwargs)


def fit_ddp(module: Net, rows: int) -> dict[str, float]:
    """Fit on 2 forked CPU ranks (``ddp_fork``: no new interpreter, nothing to import); each
    rank takes every other row (``rank::2``), so with micro-batches of 3 and windows of 3 the
    ranks' windows together are rows 0-17, 18-35, ... (the full-batch run's batches of 18)."""

    class Halves(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader[Any]:
            x, y = data(rows)
            rank = self.trainer.global_rank  # type: ignore[union-attr]
            return DataLoader(TensorDataset(x[rank::2], y[rank::2]), batch_size=MICRO)

    trainer = ddp_fork_trainer(EPOCHS, _Report(), use_distributed_sampler=False)
    trainer.fit(module, datamodule=Halves())
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.slow
def test_lightning_ddp_two_ranks_exact_with_one_gradient_sync_per_update() -> None:
    ours = Net(every=EVERY)
    got = fit_ddp(ours, rows=44)  # per rank 22 rows: windows of 9, 9, 4 rows
    full = fit(Net(), 2 * FULL, rows=44)  # batches of 18, 18, 8 rows
    assert rel(ours, full.lightning_module) <= 1e-12
    assert got["ranks_apart"] == 0.0
    assert got["global_step"] == got["updates"] == UPDATES
    assert got["grad_syncs"] == UPDATES  # not one per micro-batch (16)
    assert got["ddp_syncs"] == 2 * 2  # full windows: DDP's own sync, overlapped with backward


@pytest.mark.slow
def test_lightning_ddp_manual_optimization_exact_with_one_gradient_sync_per_update() -> None:
    # manual_backward runs inside DDP's forward, before there are outputs: the callback has
    # the wrapper count at the parameters (set_model(..., count_at="parameters"))
    ours = Net(every=EVERY, manual=True)
    got = fit_ddp(ours, rows=44)  # per rank 22 rows: windows of 9, 9, 4 rows
    full = fit(Net(manual=True), 2 * FULL, rows=44)
    assert rel(ours, full.lightning_module) <= 1e-12
    assert got["ranks_apart"] == 0.0
    assert got["global_step"] == got["updates"] == UPDATES
    # one per update (not one per micro-batch, 16), and the first micro-step after each
    # epoch-end flush but the last: the released wrapper leaves DDP its own sync setting
    assert got["grad_syncs"] == UPDATES + EPOCHS - 1


@pytest.mark.slow
def test_lightning_example_digits_on_two_ddp_processes_is_exact_at_the_first_window() -> None:
    """``torchrun --nproc-per-node 2 examples/lightning_digits.py``: Lightning's DDP on gloo,
    the wrapper learning the strategy's module; the first window against Lightning's own
    full-batch DDP step (float64)."""
    import re

    from helpers import torchrun_example

    out = torchrun_example("lightning_digits.py", "--epochs", "2")
    rel = re.search(r"rel param diff = (\d\.\d+e[+-]\d+)", out)
    assert rel is not None and float(rel.group(1)) <= 1e-12, out
    assert "2 rank(s)" in out and "trainer.global_step 6" in out


class _SaveAt(L.Callback):
    """Save a checkpoint (every rank takes part; rank 0 writes it) at the end of one batch."""

    def __init__(self, batch: int, path: Path) -> None:
        self.batch, self.path = batch, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if args[-1] == self.batch:  # batch_idx
            trainer.save_checkpoint(self.path)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [4, 5], ids=["inside a window", "at its boundary"])
def test_lightning_ddp_resume_from_inside_a_window_is_refused_on_every_rank(
    tmp_path: Path, batch: int
) -> None:
    """Lightning's DDP saves rank 0's optimizer state alone and loads it on every rank: a
    window saved inside a window (rank 0's partial gradient and items) would train rank 1 on
    rank 0's window, a wrong update with no error. Every rank refuses it before any update
    (the ranks agree through the strategy; rank 1 names the mismatch); a checkpoint saved at
    a window's boundary resumes as before."""
    ckpt = tmp_path / "mid.ckpt"

    x, y = data(44)
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO)
    ddp_fork_trainer(1, _SaveAt(batch, ckpt)).fit(Net(every=EVERY), loader)
    second = ddp_fork_trainer(2)
    if batch == 5:
        second.fit(Net(every=EVERY), loader, ckpt_path=ckpt)
        return
    refused = r"another rank refused the checkpoint's open window|saved by rank 0 of 2"
    with pytest.raises(Exception, match=refused):
        second.fit(Net(every=EVERY), loader, ckpt_path=ckpt)


def test_lightning_asks_a_window_schedule_that_raised_before_deciding_the_batch() -> None:
    """Lightning asks, before each batch, whether its backward pass closes the window: with a
    window schedule that raised when asked for the window's size, the answer came from the
    last window's stale size (found by review; a closing batch steps and clips). The schedule
    is asked again first."""
    from accumopt.integrations import lightning as integration

    failed: list[bool] = []

    def schedule(updates: int, _seen: float) -> int:
        if updates == 1 and not failed:
            failed.append(True)
            raise RuntimeError("transient")
        return 1 if updates == 0 else 3

    model = torch.nn.Linear(2, 1)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=schedule)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="transient"):
        opt.step()  # window 1 applied, then the schedule raised for window 2
    assert not integration._next_closes(opt)  # asked again (3), not the stale size 1
    assert opt.every == 3 and failed == [True]


class SharedStep(Net):
    """A ``validation_step`` sharing the training step's loss code (``loss_over_items``)."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return loss_over_items(self, F.mse_loss(self.net(x), y, reduction="sum"), len(y))


def test_lightning_loss_over_items_in_a_validation_step_is_the_mean() -> None:
    """Outside training no backward pass follows: ``loss_over_items`` used to tell the wrapper
    the next pass's items there, refused at the sanity check with a next_items message (found
    by a fresh-eyes run). It returns the mean, and training is as without validation."""
    x, y = data()
    shared, plain = SharedStep(every=EVERY), Net(every=EVERY)
    val = DataLoader(TensorDataset(x[:10], y[:10]), batch_size=5)
    trainer = quiet_trainer([AccumulateCallback()], max_epochs=EPOCHS, val_check_interval=4)
    trainer.fit(shared, DataLoader(TensorDataset(x, y), batch_size=MICRO), val)
    fit(plain, MICRO, callbacks=[AccumulateCallback()])
    assert torch.equal(flat(shared), flat(plain))

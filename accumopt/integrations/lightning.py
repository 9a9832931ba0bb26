"""Lightning with accumopt: :class:`AccumulateCallback`, :func:`loss_over_items` (docs/
frameworks/lightning.md, ``examples/lightning_digits.py``). Lightning internals used (2.6): the
epoch loop's ``_should_accumulate`` and ``_num_ready_batches_reached``, ``LightningOptimizer``'s
per-optimizer class and step callbacks, the precision plugin's ``_after_closure``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from accumopt import Accumulate

__all__ = ["AccumulateCallback", "loss_over_items"]

_OWN = frozenset(vars(LightningOptimizer)) | {"__class__", "__dict__", "flush"}  # + its __dict__


def loss_over_items(
    module: pl.LightningModule, loss_sum: Tensor, items: float | Tensor, optimizer: Any = None
) -> Tensor:
    """The loss to backward for a micro-batch whose 0-dim summed loss covers ``items`` items
    (this rank's): with an ``Accumulate`` (``optimizer``, where the module has several)
    ``opt.next_items(items)`` and ``loss_sum``; else, and outside training (a ``validation_step``
    sharing the code: no backward pass follows), the mean. ValueError: several optimizers, no
    ``optimizer``; bad ``items``. RuntimeError: no callback; ``next_items`` refused."""
    if not module.trainer.training or not torch.is_grad_enabled():
        return loss_sum / items
    if optimizer is None:
        optimizer = module.optimizers(use_pl_optimizer=False)
        if isinstance(optimizer, list):
            n = len(optimizer)
            raise ValueError(f"loss_over_items: {n} optimizers; pass optimizer=<the one it feeds>.")
    if not isinstance(optimizer, Accumulate):
        return loss_sum / items
    if not any(isinstance(c, AccumulateCallback) for c in module.trainer.callbacks):  # type: ignore[attr-defined]
        raise RuntimeError(
            "loss_over_items: the Trainer has no AccumulateCallback, so Lightning would step an "
            "Accumulate every micro-batch; expected Trainer(callbacks=[AccumulateCallback()])."
        )
    optimizer.next_items(items)
    return loss_sum


class AccumulateCallback(pl.Callback):
    """Make a ``Trainer`` step every :class:`~accumopt.Accumulate` of ``configure_optimizers``
    once per window (docs/frameworks/lightning.md): only a batch that closes a window, or the
    epoch's last, is a Lightning optimizer step. ``self.optimizers()`` is the wrapper for every
    attribute but Lightning's own. After a fit the wrappers stop counting.

    Raises (from ``trainer.fit``, before any update): ValueError: no ``Accumulate``;
    ``accumulate_grad_batches != 1`` (also checked every batch); a strategy that accumulates
    itself; ``"16-mixed"``; in automatic optimization ``every_items`` or a step scheduler with
    ``frequency != 1``. RuntimeError: a second manual ``opt.step()`` in the epoch's last batch.
    """

    def __init__(self) -> None:
        self._accs: list[Accumulate] = []
        self._trainer: pl.Trainer | None = None
        self._undo: list[tuple[Any, str]] = []  # (object, attribute) replaced for the fit
        self._handles: list[Any] = []  # the wrappers' load_state_dict hooks
        self._decision = (-1, False)  # (batch, accumulate?) decided at the batch's start
        self._flushed: dict[int, int] = {}  # id(wrapper) -> the batch whose step flushed it

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._accs = [o for o in trainer.optimizers if isinstance(o, Accumulate)]
        _check_setup(trainer, pl_module, self._accs)
        self._trainer, self._decision, self._flushed = trainer, (-1, False), {}
        model = trainer.strategy.model  # manual_backward runs inside DDP's forward:
        count_at = "outputs" if pl_module.automatic_optimization else "parameters"
        for acc in self._accs:
            acc.reattach()  # returned again after an earlier fit released it
            acc.driven_by = "AccumulateCallback"  # the Trainer's steps go through this callback
            if isinstance(model, DistributedDataParallel) and acc.model is not model:
                acc.set_model(model, count_at=count_at)
            _keep_out_of_grad(acc)  # left open by a fit that raised; or restored after this:
            self._handles.append(acc.register_load_state_dict_post_hook(_keep_out_of_grad))
            if trainer.world_size > 1:  # every rank loads rank 0's optimizer state
                self._handles.append(acc.agree_on_loads(trainer.strategy.reduce_boolean_decision))
        wrapped = pl_module.optimizers()
        for lopt in wrapped if isinstance(wrapped, list) else [wrapped]:
            if isinstance(lopt.optimizer, Accumulate):
                _route_to_wrapper(lopt, self)
        loop = trainer.fit_loop.epoch_loop
        self._replace(loop, "_should_accumulate", partial(self._should_accumulate, pl_module))
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecision):  # bf16: it refuses to clip for an optimizer whose
            # step() takes GradScaler's arguments (Accumulate's), yet .grad is plain here
            self._replace(plugin, "clip_gradients", partial(Precision.clip_gradients, plugin))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for acc in self._accs:  # left open by an epoch cut short (training_step -> None)
            acc.flush()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for obj, name in self._undo:
            obj.__dict__.pop(name, None)
        for acc in self._accs:
            acc.release()  # stops counting: another fit's passes are not its own
            acc.driven_by = None
        for handle in self._handles:
            handle.remove()
        self._undo, self._handles, self._trainer = [], [], None

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # the open window stays, for a checkpoint

    def _replace(self, obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)
        self._undo.append((obj, name))

    def _should_accumulate(self, pl_module: pl.LightningModule) -> bool:
        """Lightning's "no optimizer step for this batch?": in automatic optimization asked
        before the pass (kept for the batch), in manual after it (is a window open?)."""
        assert self._trainer is not None
        _check_no_lightning_accumulation(self._trainer)
        if not pl_module.automatic_optimization:
            return any(acc.micro_step > 0 for acc in self._accs)
        loop = self._trainer.fit_loop.epoch_loop
        batch = loop.batch_progress.total.ready
        if self._decision[0] != batch:
            closes = self._accs[0].will_update or _next_closes(self._accs[0])
            self._decision = (batch, not (closes or loop._num_ready_batches_reached()))
        return self._decision[1]

    def _step(self, lopt: LightningOptimizer, closure: Callable[[], Any] | None, **kw: Any) -> Any:
        """``LightningOptimizer.step``: Lightning's own only for a micro-step that updates."""
        acc: Accumulate = lopt.optimizer  # type: ignore[assignment]
        if self._trainer is None:  # a proxy kept from an earlier fit
            return acc.step(closure)
        loop = self._trainer.fit_loop.epoch_loop
        batch = loop.batch_progress.total.ready
        if self._flushed.get(id(acc)) == batch:
            raise RuntimeError(
                "AccumulateCallback: opt.step() was called again in the epoch's last batch, "
                "after its first applied the epoch's last window; expected one per batch."
            )
        if closure is not None and _next_closes(acc):  # its backward pass closes the window
            return LightningOptimizer.step(lopt, closure, **kw)
        value, before = None, acc.micro_step
        if closure is not None:
            with torch.enable_grad():
                value = closure()  # the micro-step's forward and backward, before deciding
        if acc.will_update:
            return LightningOptimizer.step(lopt, lambda: value, **kw)
        if closure is None or value is not None or acc.micro_step != before:
            acc.step()  # a micro-step inside the window (None: Lightning skipped the batch)
        if self._trainer.training and loop._num_ready_batches_reached():
            self._flushed[id(acc)] = batch
            self._flush(lopt)
        return value

    def _flush(self, lopt: LightningOptimizer) -> bool:
        """``opt.flush()`` as a Lightning optimizer step (counted; hooks and clipping run)."""
        acc: Accumulate = lopt.optimizer  # type: ignore[assignment]
        if self._trainer is None or not acc.micro_step:
            return acc.flush()
        module, precision = self._trainer.lightning_module, self._trainer.precision_plugin
        lopt._on_before_step()  # manual optimization: the step count behind global_step
        handle = acc.optimizer.register_step_pre_hook(
            lambda *_: precision._after_closure(module, acc)  # hooks, then clipping
        )
        try:
            applied = acc.flush()
        finally:
            handle.remove()
        lopt._on_after_step()
        return applied


def _next_closes(acc: Accumulate) -> bool:
    """Whether the next backward pass surely closes ``acc``'s window (a schedule is asked)."""
    every = None if acc.will_update else acc.every
    return every is not None and acc.micro_step + 1 >= every


def _keep_out_of_grad(acc: Any) -> None:
    """Move an open window out of the ``.grad`` Lightning zeroes at a fit's start, into the
    wrapper's buffer (RuntimeError where it cannot)."""
    try:
        if acc.micro_step:
            acc.enable_rollback()
    except RuntimeError as err:
        raise RuntimeError(f"AccumulateCallback: a fit that starts mid-window: {err}") from err


def _route_to_wrapper(lopt: LightningOptimizer, callback: AccumulateCallback) -> None:
    """Make ``self.optimizers()`` the wrapper for every attribute but Lightning's own (its
    per-optimizer class); ``step`` and ``flush`` go to the callback."""
    cls, get = type(lopt), object.__getattribute__

    def own(self: LightningOptimizer, name: str) -> bool:
        return name in _OWN or name in get(self, "__dict__")

    def __getattribute__(self: LightningOptimizer, name: str) -> Any:
        return get(self, name) if own(self, name) else getattr(get(self, "_optimizer"), name)

    def __setattr__(self: LightningOptimizer, name: str, value: Any) -> None:
        if own(self, name):
            object.__setattr__(self, name, value)
        else:
            setattr(self._optimizer, name, value)

    cls.__getattribute__ = __getattribute__  # type: ignore[method-assign, assignment]
    cls.__setattr__ = __setattr__  # type: ignore[method-assign, assignment]
    cls.step = lambda self, closure=None, **kw: callback._step(self, closure, **kw)  # type: ignore[method-assign]
    cls.flush = lambda self: callback._flush(self)  # type: ignore[attr-defined]


def _check_no_lightning_accumulation(trainer: pl.Trainer) -> None:
    steps = trainer.accumulate_grad_batches
    if steps != 1:
        raise ValueError(
            f"AccumulateCallback: Trainer(accumulate_grad_batches={steps}) makes each update "
            f"1/{steps} of the right one; expected 1 (and no GradientAccumulationScheduler)."
        )


def _check_setup(trainer: pl.Trainer, module: pl.LightningModule, accs: list[Accumulate]) -> None:
    """Refuse what would make the updates silently wrong (see AccumulateCallback)."""
    if not accs:
        got = [type(o).__name__ for o in trainer.optimizers]
        raise ValueError(
            f"AccumulateCallback: no Accumulate optimizer (got {got}); return one from "
            "configure_optimizers, e.g. Accumulate(torch.optim.SGD(...), every=4)."
        )
    _check_no_lightning_accumulation(trainer)
    if trainer.strategy.handles_gradient_accumulation:
        raise ValueError(
            f"AccumulateCallback: the {type(trainer.strategy).__name__} accumulates gradients "
            "itself; expected a single device or DDP, or use its own accumulation."
        )
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        raise ValueError(
            "AccumulateCallback: precision='16-mixed': hooks and clipping would see scaled "
            "gradients (unscaled only in the step). Expected 'bf16-mixed' or '32-true'."
        )
    if module.automatic_optimization and accs[0].every is None:
        raise ValueError(
            f"AccumulateCallback: Accumulate(every_items={accs[0].every_items:g}) in automatic "
            "optimization (Lightning decides before a batch whether it steps); expected every=N."
        )
    for config in trainer.lr_scheduler_configs if module.automatic_optimization else []:
        if config.interval == "step" and config.frequency != 1:
            raise ValueError(
                f"AccumulateCallback: a step scheduler with frequency={config.frequency}: "
                "Lightning counts micro-batches for it, not updates. Expected frequency=1."
            )

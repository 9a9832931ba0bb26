"""Lightning (``lightning.pytorch``) with accumopt: one callback, no change to the training loop.

Return an :class:`~accumopt.Accumulate` from ``configure_optimizers`` and add
:class:`AccumulateCallback` to the ``Trainer``; keep ``accumulate_grad_batches=1`` (the
default). Each ``training_step`` call is one micro-step::

    from accumopt import Accumulate
    from accumopt.integrations.lightning import AccumulateCallback, loss_over_items

    class Net(L.LightningModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss_sum = F.cross_entropy(self.net(x), y, reduction="sum")
            return loss_over_items(self, loss_sum, len(y))  # exact weight of a ragged batch

        def configure_optimizers(self):
            return Accumulate(torch.optim.SGD(self.parameters(), lr=0.1), every=4)

    L.Trainer(callbacks=[AccumulateCallback()], gradient_clip_val=1.0).fit(Net(), loader)

What the callback makes Lightning do (automatic optimization):

- **Steps**: a batch inside a window is a Lightning *accumulation* batch (training_step and
  backward only: no ``optimizer_step``, no hooks), the batch that closes the window an
  optimizer step. So ``trainer.global_step``, ``max_steps``, step-interval LR schedulers and
  the logging step count real updates, as without accumulation.
- **Hooks and clipping**: ``on_before_optimizer_step`` and ``gradient_clip_val`` /
  ``configure_gradient_clipping`` run once per update, on the window's mean gradient (Lightning
  runs them inside the closure, after the backward pass that closes the window).
- **The epoch's short last window** is applied at the epoch's last batch (``opt.flush()``),
  with the same hooks and clipping on its mean (run just before the inner step).
- **Items**: :func:`loss_over_items` (``opt.next_items(n)`` on the wrapper, the loss summed):
  each micro-batch weighs by its items (samples, tokens); without ``Accumulate`` it returns the
  mean, so one module trains both ways.
- **DDP**: ``opt.set_model(trainer.strategy.model)`` at fit start: one gradient sync per update
  and items summed over the ranks.

Manual optimization: call ``opt.step()`` / ``opt.zero_grad()`` once per ``training_step`` as
usual (``opt = self.optimizers()``, whose calls reach the wrapper). ``opt.step()`` goes through
Lightning (hooks, the step count behind ``global_step``) only when it updates; at the epoch's
last batch it applies the short last window. Step schedulers yourself when ``opt.did_update``.

Limits: ``every_items`` needs manual optimization (Lightning decides before a batch runs
whether it steps); ``trainer.estimated_stepping_batches`` counts batches (divide by ``every``);
``on_before_zero_grad`` and ``on_after_backward`` run every micro-step (``.grad`` then holds
the window's running sum, and its mean after the closing micro-step); for the flushed last
window, hooks and Lightning's clipping run after the wrapper's own ``max_grad_norm`` clipping
(before it at other updates; set one of the two). At the end of a ``fit`` (or its exception)
the callback stops its wrappers counting the module's backward passes, so the module can be
fit again with the new wrappers ``configure_optimizers`` returns; a wrapper returned again
counts again and goes on where it stood (a window left open by a failed fit included). A
fit that starts inside a window (resumed from a checkpoint saved mid-window, or that window
left open) keeps the window in the wrapper's buffer for that fit, out of ``.grad``, which
Lightning zeroes at the fit's start.
Lightning internals used (tested with 2.6): the training epoch loop's ``_should_accumulate``
(replaced during ``fit``) and ``_num_ready_batches_reached``, ``LightningOptimizer``'s
per-optimizer class and step callbacks, and the precision plugin's ``_after_closure``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from accumopt import _binding
from accumopt._entry_checks import owners_agree
from accumopt.accumulate import AccumulatingOptimizer

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "accumopt.integrations.lightning needs Lightning, which is not installed: "
        'pip install "accumopt[lightning]" (or pip install lightning).'
    ) from err

__all__ = ["AccumulateCallback", "loss_over_items"]

_WHAT_TO_DO = "Remove it: the Accumulate wrapper accumulates by itself."


def loss_over_items(
    module: pl.LightningModule,
    loss_sum: Tensor,
    items: float | Tensor,
    optimizer: torch.optim.Optimizer | None = None,
) -> Tensor:
    """What ``training_step`` returns (or hands to ``manual_backward``) for a micro-batch whose
    summed loss covers ``items`` items.

    With an :class:`~accumopt.Accumulate` optimizer it calls ``opt.next_items(items)`` and
    returns ``loss_sum``: the window's gradient is then the mean over every item of the window,
    however the items were spread over micro-batches (ragged batches, token counts). With any
    other optimizer it returns ``loss_sum / items``, the usual mean loss.

    Args:
        module: the LightningModule (call it from ``training_step``, once per backward pass).
        loss_sum: 0-dim tensor, the loss *summed* over the micro-batch's items (e.g.
            ``F.cross_entropy(..., reduction="sum")``), any float dtype.
        items: how many items ``loss_sum`` covers (samples, or tokens that carry a loss): a
            number >= 0 or a one-element tensor (one host sync); this rank's own under DDP.
        optimizer: which optimizer the next backward pass feeds, where ``configure_optimizers``
            returned several (raw or as ``self.optimizers()`` gives it); default: the only one.

    Returns:
        ``loss_sum`` (with Accumulate) or ``loss_sum / items`` (without): a 0-dim tensor.

    Raises:
        ValueError: several optimizers and no ``optimizer``; bad ``items`` or a count already
            pending (from ``next_items``).
        RuntimeError: the module is not attached to a Trainer; an Accumulate optimizer without
            an :class:`AccumulateCallback` in the Trainer; ``next_items`` refused.
    """
    if optimizer is None:
        found = module.optimizers(use_pl_optimizer=False)
        if isinstance(found, list):
            raise ValueError(
                f"loss_over_items: the module has {len(found)} optimizers; expected one, or "
                "optimizer=<the one the next backward pass feeds>."
            )
        optimizer = found
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, AccumulatingOptimizer):
        callbacks = getattr(module.trainer, "callbacks", [])  # set by the Trainer, undeclared
        if not any(isinstance(c, AccumulateCallback) for c in callbacks):
            raise RuntimeError(
                "loss_over_items: configure_optimizers returned an Accumulate optimizer but the "
                "Trainer has no AccumulateCallback: Lightning would step, clip and count it on "
                "every micro-batch. Expected Trainer(callbacks=[AccumulateCallback()])."
            )
        optimizer.next_items(items)
        return loss_sum
    return loss_sum / items


class AccumulateCallback(pl.Callback):
    """Make a ``Trainer`` step every :class:`~accumopt.Accumulate` returned by
    ``configure_optimizers`` once per window, exactly (see the module docstring).

    Takes no arguments; add one instance to ``Trainer(callbacks=[...])``. At ``on_fit_start``
    it checks the configuration, gives each wrapper the strategy's DDP module (automatic
    optimization), routes ``self.optimizers()`` calls to the wrapper and tells Lightning's
    training loop which batches are accumulation batches; ``teardown`` (and ``on_exception``)
    undoes the last and stops the wrappers counting the module's backward passes.

    Raises (from ``trainer.fit``, before any update unless stated):
        ValueError: no ``Accumulate`` among the optimizers; ``accumulate_grad_batches != 1``
            (checked again every batch, as callbacks may change it); a strategy that
            accumulates itself (DeepSpeed); ``every_items`` in automatic optimization; a
            step-interval LR scheduler with ``frequency != 1`` (Lightning counts its
            frequency in batch indices, which are no longer updates).
        RuntimeError: in manual optimization, a further ``opt.step()`` in the epoch's last
            batch after the short last window was applied there (raised at that call).
    """

    def __init__(self) -> None:
        self._accs: list[AccumulatingOptimizer] = []
        self._loop: Any = None  # the training epoch loop whose _should_accumulate is ours
        self._decision = (-1, False)  # (batch, accumulate?) decided at the batch's start
        self._flushed: dict[int, int] = {}  # id(wrapper) -> the batch whose step flushed it
        self._handles: list[Any] = []  # the wrappers' load_state_dict hooks

    # ------------------------------------------------------------------ Lightning hooks

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the configuration and wire the wrappers in (see the class docstring)."""
        self._accs = [o for o in trainer.optimizers if isinstance(o, AccumulatingOptimizer)]
        _check_setup(trainer, pl_module, self._accs)
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            # one gradient sync per update, items over the ranks; manual_backward runs inside
            # DDP's forward, before any output exists: count those passes at the parameters
            count_at = "outputs" if pl_module.automatic_optimization else "parameters"
            for acc in self._accs:
                if acc.model is not model:
                    acc.set_model(model, count_at=count_at)
        for acc in self._accs:
            _binding.reattach(acc)  # returned again after an earlier fit released it
            _binding.keep_out_of_grad(acc)  # a window left open by a fit that raised
            # Lightning restores a checkpoint after this hook: the window it may hold too
            self._handles.append(acc.register_load_state_dict_post_hook(_binding.keep_out_of_grad))
            if trainer.world_size > 1:  # every rank loads rank 0's optimizer state
                agree = owners_agree(trainer.strategy.reduce_boolean_decision)
                self._handles.append(acc.register_load_state_dict_pre_hook(agree))
        wrapped = pl_module.optimizers(use_pl_optimizer=True)
        for lopt in wrapped if isinstance(wrapped, list) else [wrapped]:
            if isinstance(lopt.optimizer, AccumulatingOptimizer):
                _route_to_wrapper(lopt, self)
        self._loop = trainer.fit_loop.epoch_loop
        self._loop._should_accumulate = lambda: self._should_accumulate(trainer, pl_module)
        self._decision, self._flushed = (-1, False), {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply a window still open at the epoch's end (normally applied at its last batch
        already; left open by an epoch cut short, e.g. a training_step that returned None)."""
        for acc in self._accs:
            acc.flush()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give Lightning's training loop its own accumulation rule back, and stop the wrappers
        counting the module's backward passes (:func:`accumopt._binding.release`): a later
        fit of the module with other wrappers must not be counted into these."""
        if self._loop is not None:
            self._loop.__dict__.pop("_should_accumulate", None)
            self._loop = None
        for acc in self._accs:
            _binding.release(acc)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """A fit that raised: as :meth:`teardown` (Lightning runs no teardown hook then). The
        open window stays in the wrappers, for a checkpoint callback that saves it."""
        self.teardown(trainer, pl_module, "fit")

    # ------------------------------------------------------------------ the wiring

    def _should_accumulate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Lightning's question "is this batch an accumulation batch (no optimizer step)?".

        Automatic optimization asks before the batch runs: yes unless the batch's backward pass
        closes the window (``every`` is known) or the batch is the epoch's last; the answer is
        kept for the batch. Manual optimization asks after it: whether a window is open.
        """
        _check_no_lightning_accumulation(trainer)
        loop = self._loop
        if not pl_module.automatic_optimization:
            return any(acc.micro_step > 0 for acc in self._accs)
        batch = loop.batch_progress.total.ready
        if self._decision[0] != batch:
            acc = self._accs[0]
            closes = acc.will_update or _next_closes(acc)
            self._decision = (batch, not (closes or loop._num_ready_batches_reached()))
        return self._decision[1]

    def _step(
        self,
        lopt: LightningOptimizer,
        closure: Callable[[], Any] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """``LightningOptimizer.step`` of a wrapper: Lightning's own step (hooks, clipping,
        progress) only for a micro-step that updates; a plain wrapper step inside the window;
        the short last window applied at the epoch's last batch."""
        acc: AccumulatingOptimizer = lopt.optimizer  # type: ignore[assignment]
        trainer = lopt._strategy.lightning_module.trainer  # type: ignore[union-attr]
        loop = self._loop
        batch = loop.batch_progress.total.ready
        if self._flushed.get(id(acc)) == batch:
            raise RuntimeError(
                "AccumulateCallback: opt.step() was called again in the epoch's last batch, "
                "after the epoch's last window was applied at that batch's first opt.step(); "
                "expected one opt.step() per training_step in manual optimization. Run the "
                "micro-steps of one batch in separate training_step calls (batches)."
            )
        if closure is not None and _next_closes(acc):  # its backward pass closes the window
            return LightningOptimizer.step(lopt, closure, **kwargs)
        value, before = None, acc.micro_step
        if closure is not None:
            with torch.enable_grad():
                value = closure()  # the micro-step's forward and backward, before deciding
        if acc.will_update:
            return LightningOptimizer.step(lopt, lambda: value, **kwargs)
        if closure is None or value is not None or acc.micro_step != before:
            acc.step()  # a micro-step inside the window (raises without a backward pass)
        # else: training_step returned None (Lightning skips the batch): no micro-step to end
        if trainer.training and loop._num_ready_batches_reached():
            self._flushed[id(acc)] = batch
            _apply_last_window(lopt, acc, trainer)
        return value


def _next_closes(acc: AccumulatingOptimizer) -> bool:
    """Whether the next backward pass surely closes ``acc``'s window (``every`` only; a window
    schedule that has not answered is asked now, before the batch)."""
    window = acc._window  # no valid size: the batch's backward pass is refused
    return window.answered() and not acc.will_update and window.next_closes()


def _apply_last_window(
    lopt: LightningOptimizer, acc: AccumulatingOptimizer, trainer: pl.Trainer
) -> None:
    """``acc.flush()`` as a Lightning optimizer step: counted by the loop like one, with
    ``on_before_optimizer_step`` and gradient clipping run on the window's mean just before the
    inner step (a pre-step hook of the inner optimizer, removed afterwards)."""
    module = trainer.lightning_module
    precision = trainer.precision_plugin

    def before_inner_step(*_: Any) -> None:
        precision._after_closure(module, acc)  # the hooks, then clipping, as in Lightning

    lopt._on_before_step()  # manual optimization: the step count behind global_step
    handle = acc.optimizer.register_step_pre_hook(before_inner_step)
    try:
        acc.flush()
    finally:
        handle.remove()
    lopt._on_after_step()


def _route_to_wrapper(lopt: LightningOptimizer, callback: AccumulateCallback) -> None:
    """Send ``self.optimizers()`` calls to the wrapper itself.

    ``LightningOptimizer`` gives each optimizer a class of its own that subclasses the
    optimizer's class: a wrapper method called through it would run on the LightningOptimizer
    (``next_items``, ``flush`` and others store state on ``self``, which would be lost). Every
    public method and property of the wrapper's class (and of its bases, ``torch.optim``'s
    included) is forwarded instead, and ``step`` goes to the callback.
    """
    cls = type(lopt)
    if cls is LightningOptimizer:  # pragma: no cover - Lightning always makes its own class
        return
    own = set(dir(LightningOptimizer))
    for name in dir(AccumulatingOptimizer):
        value = inspect.getattr_static(AccumulatingOptimizer, name)
        if name.startswith("_") or name in own:
            continue
        if isinstance(value, property):
            setattr(cls, name, property(_forwarded(name, call=False)))
        elif inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)):
            setattr(cls, name, _forwarded(name))

    def step(self: LightningOptimizer, closure: Callable[[], Any] | None = None, **kw: Any) -> Any:
        return callback._step(self, closure, kw)

    cls.step = step  # type: ignore[method-assign]


def _forwarded(name: str, call: bool = True) -> Callable[..., Any]:
    def method(self: LightningOptimizer, *args: Any, **kwargs: Any) -> Any:
        value = getattr(self.optimizer, name)
        return value(*args, **kwargs) if call else value

    method.__name__ = name
    method.__doc__ = f"``Accumulate.{name}`` of the wrapped optimizer."
    return method


def _check_no_lightning_accumulation(trainer: pl.Trainer) -> None:
    steps = trainer.accumulate_grad_batches
    if steps != 1:
        raise ValueError(
            f"AccumulateCallback: Trainer(accumulate_grad_batches={steps}) with an Accumulate "
            f"optimizer: Lightning would divide every loss by {steps} and step only every "
            f"{steps} batches, on top of the wrapper's own window, so every update would be "
            f"1/{steps} of the right one. Expected accumulate_grad_batches=1 (the default; "
            f"also no GradientAccumulationScheduler). {_WHAT_TO_DO}"
        )


def _check_setup(
    trainer: pl.Trainer, pl_module: pl.LightningModule, accs: list[AccumulatingOptimizer]
) -> None:
    """Refuse what would make the updates silently wrong (see AccumulateCallback)."""
    if not accs:
        raise ValueError(
            "AccumulateCallback: configure_optimizers returned no Accumulate optimizer "
            f"(got {[type(o).__name__ for o in trainer.optimizers]}); expected e.g. "
            "Accumulate(torch.optim.SGD(self.parameters(), lr=0.1), every=4), or remove "
            "the callback."
        )
    _check_no_lightning_accumulation(trainer)
    if trainer.strategy.handles_gradient_accumulation:
        raise ValueError(
            f"AccumulateCallback: the {type(trainer.strategy).__name__} accumulates gradients "
            "itself (it owns the gradients and the step); expected a strategy that does not "
            "(single device, DDP). Use its own accumulation setting instead of Accumulate."
        )
    if pl_module.automatic_optimization:
        if accs[0].every is None:
            raise ValueError(
                f"AccumulateCallback: Accumulate(every_items={accs[0].every_items:g}) in "
                "automatic optimization: Lightning decides before a batch runs whether it "
                "steps, and a window in items ends only after its last backward pass. "
                "Expected every=N (micro-batches per update; items still weight each one), "
                "or manual optimization (self.automatic_optimization = False)."
            )
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and config.frequency != 1:
                raise ValueError(
                    f"AccumulateCallback: an LR scheduler with interval='step' and "
                    f"frequency={config.frequency}: Lightning checks the frequency against "
                    "the batch index, which counts micro-batches, not updates, so it would "
                    "step at the wrong updates. Expected frequency=1; to change the rate every "
                    f"{config.frequency} updates, build that into the schedule (e.g. a "
                    f"LambdaLR of step // {config.frequency})."
                )

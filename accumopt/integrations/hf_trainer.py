"""The Hugging Face ``transformers.Trainer`` with accumopt: :class:`AccumulateTrainer`.

Use it where you would use ``Trainer``; the micro-batch is ``per_device_train_batch_size``, the
window is the wrapper's ``every`` (see ``examples/hf_trainer_charlm.py``)::

    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=3e-4), every=8)
    trainer = AccumulateTrainer(model=model, args=args, train_dataset=ds,
                                data_collator=collate, optimizers=(opt, None))
    trainer.train()          # one update per 8 micro-batches: the mean over all their tokens

How it fits the Trainer's loop (transformers 5.x):

- The Trainer accumulates with ``gradient_accumulation_steps`` = ``every`` (on a copy of
  ``args``): ``global_step``, ``max_steps``, epochs, logging/saving cadence and the LR schedule
  count real updates; the epoch's short last window is applied with ``opt.flush()``.
- A micro-batch's loss is the Trainer's (``compute_loss`` with ``num_items_in_batch=None``: the
  mean over its items, from the model or ``compute_loss_func``) times its item count
  (:meth:`AccumulateTrainer.count_items`), weighted with ``opt.next_items(n)``: each update is
  the mean over every item of the window, over all ranks, with or without loss kwargs. A model
  whose loss is another kind (``loss_type`` ``ForCTC``...) is refused at ``train()`` unless
  ``count_items`` is overridden (``accumopt/integrations/_hf_loss.py``).
- The Trainer's ``optimizer.step()`` steps (or flushes) the wrapper, so its ``model.zero_grad()``
  runs between windows only; clipping is the wrapper's (``max_grad_norm``), and the logged
  ``grad_norm`` is the window's pre-clip norm. Under DDP: ``opt.set_model(ddp_model)``.
- A checkpoint written mid-window (the Trainer writes at updates only; a JIT/SIGTERM checkpoint
  writes before the update) also holds each rank's window (``accumopt_window_rank{r}.pt``);
  on resume the micro-batches it holds are skipped: bit for bit the uninterrupted run.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from accumopt.accumulate import AccumulatingOptimizer
from accumopt.distributed import is_distributed
from accumopt.integrations import _hf_window_file as window_file
from accumopt.integrations._hf_boundary import Boundary, find
from accumopt.integrations._hf_loss import (
    aux_loss_warning,
    loss_refusal,
    loss_shifts,
    smoother_shifts,
    zero_loss,
)
from accumopt.integrations._hf_window_file import WINDOW_FILE


class TransformersMissing(ImportError):
    """Raised on import without transformers/accelerate (``pip install
    "accumopt[transformers]"``)."""


try:
    from accelerate.optimizer import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        AcceleratedOptimizer,
    )
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise TransformersMissing(
        "accumopt.integrations.hf_trainer needs Hugging Face transformers (and accelerate), "
        'which are not installed: pip install "accumopt[transformers]".'
    ) from err

__all__ = ["WINDOW_FILE", "AccumulateTrainer", "TransformersMissing", "check_trainer_hooks"]

_IGNORE_INDEX = -100  # the label every Hugging Face loss ignores
_LOG = logging.getLogger("accumopt")
_DROPPED = (
    "AccumulateTrainer.train: dropped the open window of %d micro-step(s) the wrapper held: a "
    "training started afresh (no resume_from_checkpoint) zeroes the gradients first. To go "
    "on with it, resume from the checkpoint it was saved in: train(resume_from_checkpoint=...)."
)
_STEPPED_INSIDE = (
    "AccumulateTrainer: the wrapper was about to update inside the Trainer's window (stepped from "
    "training_step, e.g. by a MicroBatchRunner); expected the Trainer to step it once per window. "
    "Nothing was applied. Let the Trainer cut the micro-batches instead "
    "(per_device_train_batch_size, gradient_accumulation_steps)."
)

# the Trainer methods AccumulateTrainer overrides or calls (transformers 5.x, tested on 5.24)
_HOOKS = "training_step compute_loss get_batch_samples create_optimizer _prepare_for_training"
_HOOKS += " _clip_grad_norm _get_grad_norm _save_optimizer_and_scheduler _load_optimizer_and_"
_HOOKS += "scheduler _save_checkpoint create_accelerator_and_postprocess"


def check_trainer_hooks(trainer_cls: type) -> None:
    """Refuse a ``Trainer`` class that lacks a method :class:`AccumulateTrainer` overrides.

    Raises:
        ImportError: naming the missing methods (another transformers version: the override
            would never run, and the Trainer would step every micro-batch).
    """
    missing = [name for name in _HOOKS.split() if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise ImportError(
            f"accumopt.integrations.hf_trainer: {trainer_cls.__qualname__} has no "
            f"{', '.join(missing)}; expected the transformers 5.x Trainer (tested on 5.24)."
        )


check_trainer_hooks(Trainer)


class AccumulateTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is an :class:`~accumopt.Accumulate` wrapper.

    Args:
        *args, **kwargs: as for ``Trainer``. ``optimizers=(opt, scheduler)``: ``opt`` an
            ``Accumulate(..., every=k)`` (``k`` an int), or a plain torch optimizer, or None
            (the Trainer builds one from ``args``), wrapped in
            ``Accumulate(opt, every=args.gradient_accumulation_steps)``. The scheduler may be
            built on the wrapper or on the inner optimizer; None: the Trainer's, over real
            updates.
        shift_labels: whether the model's loss predicts ``labels[..., 1:]`` (a causal LM that
            shifts internally); None: with label smoothing, the smoother's own rule (a
            causal-LM class name of transformers' mapping); else read from the model
            (``_hf_loss.loss_shifts``: the loss function its ``forward`` calls; a causal-LM
            name whose loss is its own code is refused, say it here). For :meth:`count_items`.

    ``self.args`` becomes a copy with ``gradient_accumulation_steps = k`` (micro-batches per
    update, per rank). The wrapper's ``max_grad_norm`` is set to ``args.max_grad_norm`` when it
    has none (``inf`` when ``args.max_grad_norm`` is 0: the norm is measured, not clipped).

    Raises:
        TypeError: the optimizer is not a ``torch.optim.Optimizer``.
        ValueError: the wrapper's window is not ``every=<int>`` (``every_items`` or a schedule);
            ``args.gradient_accumulation_steps`` is neither 1 nor the wrapper's ``every``; the
            wrapper's ``max_grad_norm`` differs from a positive ``args.max_grad_norm``.
        RuntimeError: at ``train()``, see :meth:`check_supported`; an update from inside the
            Trainer's window (a ``MicroBatchRunner`` in ``training_step``), before it applies;
            a mid-window checkpoint without this rank's window file.
    """

    def __init__(self, *args: Any, shift_labels: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shift_labels = shift_labels
        self._norm: Tensor | None = None  # the logged grad_norm, filled at the update
        self._window_items = 0.0  # this rank's items in the Trainer's current window (logging)
        self._stepping = self._hooked = False  # inside the Trainer's step(); hook installed
        self._skip = 0  # micro-batches of a resumed window that the loaded window holds
        self._reload: dict[str, Any] | None = None  # a resumed open window, loaded at the start
        if self.optimizer is not None:
            self.optimizer = self._wrap(self.optimizer)
            self.callback_handler.optimizer = self.optimizer

    @property
    def accumulate(self) -> AccumulatingOptimizer:
        """The :class:`~accumopt.Accumulate` wrapper the Trainer steps (RuntimeError before the
        optimizer exists: pass it, or call ``train()``/``create_optimizer()`` first)."""
        opt = find(self.optimizer)
        if opt is None:
            raise RuntimeError("AccumulateTrainer: no optimizer yet; expected train() first.")
        return opt

    def _wrap(self, given: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``given`` if it is (or, once prepared, holds) an ``Accumulate``, else one around it;
        the window, ``gradient_accumulation_steps`` and clipping checked and reconciled."""
        steps = int(self.args.gradient_accumulation_steps)
        opt = find(given)
        if opt is None:
            if not isinstance(given, torch.optim.Optimizer):
                raise TypeError(
                    f"AccumulateTrainer: the optimizer is a {type(given).__qualname__}; "
                    "expected an accumopt.Accumulate or a torch.optim.Optimizer."
                )
            given = opt = AccumulatingOptimizer(given, every=steps)
        every = opt._window.spec()[0]  # a schedule, if any (opt.every: its current size)
        if isinstance(every, bool) or not isinstance(every, int):
            raise ValueError(
                f"AccumulateTrainer: the wrapper's window is every={every!r}, every_items="
                f"{opt.every_items!r}; expected Accumulate(opt, every=<int>): the Trainer's loop "
                "needs the number of micro-batches per update in advance."
            )
        if steps not in (1, every):
            raise ValueError(
                f"AccumulateTrainer: args.gradient_accumulation_steps={steps} but the wrapper "
                f"has every={every}; expected gradient_accumulation_steps=1 (the default: it is "
                f"set to {every}) or equal to every."
            )
        if steps != every:
            self.args = copy.copy(self.args)  # the caller's args stay as they were
            self.args.gradient_accumulation_steps = every
        clip = float(self.args.max_grad_norm or 0.0)
        if opt.max_grad_norm is None:
            opt.max_grad_norm = clip if clip > 0 else float("inf")
        elif clip > 0 and opt.max_grad_norm != clip:
            raise ValueError(
                f"AccumulateTrainer: Accumulate(max_grad_norm={opt.max_grad_norm}) and "
                f"TrainingArguments(max_grad_norm={clip}) differ; expected one of them (set "
                "args.max_grad_norm=0 to keep the wrapper's, or build it without one)."
            )
        return given

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """``Trainer``'s, in ``Accumulate(every=args.gradient_accumulation_steps)`` if need be."""
        opt = super().create_optimizer(model)
        self.optimizer = self._wrap(opt)
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s, with ``sync_each_batch``: no DDP ``no_sync`` from the Trainer (the
        wrapper decides which backward pass synchronises)."""
        super().create_accelerator_and_postprocess()
        self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True

    def check_supported(self) -> None:
        """Run by :meth:`train`. Raises RuntimeError for setups whose gradients the wrapper
        cannot own: DeepSpeed, FSDP, an fp16 ``GradScaler`` (bf16 needs none), ``DataParallel``,
        context/sequence parallelism, ``auto_find_batch_size``; a model whose loss is not a
        mean over the items :meth:`count_items` counts (``_hf_loss.loss_refusal``). Warns
        (UserWarning) for a per-micro-batch auxiliary loss (``_hf_loss.aux_loss_warning``)."""
        own_count = type(self).count_items is not AccumulateTrainer.count_items
        own_loss = self._own_loss()
        model = self.accelerator.unwrap_model(self.model)
        if (loss := loss_refusal(model, own_count, own_loss)) is not None:
            raise RuntimeError(loss)
        if not own_loss and (aux := aux_loss_warning(model)) is not None:
            warnings.warn(aux, UserWarning, stacklevel=3)
        problems = []
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            problems.append("DeepSpeed/FSDP (they own the gradients)")
        if getattr(self.accelerator, "scaler", None) is not None:
            problems.append("fp16 with a GradScaler (use bf16)")
        if self.args.n_gpu > 1:
            problems.append(f"DataParallel over {self.args.n_gpu} GPUs (use DDP: torchrun)")
        if self.get_cp_size() * self.get_sp_size() > 1:
            problems.append("context/sequence parallelism")
        if self.args.auto_find_batch_size:
            problems.append("auto_find_batch_size (it restarts on a changed micro-batch)")
        if problems:
            raise RuntimeError(
                "AccumulateTrainer: not supported: " + "; ".join(problems) + ". Expected a "
                "single device or DDP (torchrun), fp32/bf16."
            )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train`` (same arguments and result), after :meth:`check_supported`. A
        training that starts afresh (no ``resume_from_checkpoint``) drops, with a warning, any
        window the wrapper holds (left open by a ``train()`` stopped inside it, or loaded from a
        state_dict), as the Trainer drops a partial accumulation: it zeroes the gradients. An
        earlier train() that raised leaves nothing here (a window to load, batches to skip)."""
        self.check_supported()
        self._skip, self._reload = 0, None
        resume = args[0] if args else kwargs.get("resume_from_checkpoint")
        if not resume and (opt := find(self.optimizer)) is not None and opt.micro_step:
            _LOG.warning(_DROPPED, opt.micro_step)
            opt.discard()
        return super().train(*args, **kwargs)

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        model, loader = super()._prepare_for_training(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._adopt(model)
        prepared = self.optimizer
        if isinstance(prepared, AcceleratedOptimizer) and not isinstance(
            prepared.optimizer, Boundary
        ):
            prepared.optimizer = Boundary(self, self.accumulate)
            if not self._hooked:
                self.accumulate.optimizer.register_step_pre_hook(self._only_at_boundary)
                self._hooked = True
        return model, loader

    def _only_at_boundary(self, *_: Any) -> None:
        """Inner-optimizer pre-step hook: no update but the Trainer's, while it trains."""
        if self.is_in_train and not self._stepping:
            raise RuntimeError(_STEPPED_INSIDE)

    def _adopt(self, model: nn.Module) -> None:
        """Tell the wrapper the DDP module the Trainer wrapped the model in (between windows)."""
        opt = self.accumulate
        if is_distributed(model) and opt.model is not model:
            opt.set_model(model)

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], None]:
        """The Trainer's window: ``(batches, None)``, up to ``num_batches`` micro-batches and no
        ``num_items_in_batch`` (the wrapper counts items, over the ranks, without a gather)."""
        if self._reload is not None:  # after the Trainer's model.zero_grad() at the start
            self.accumulate.load_state_dict(self._reload)
            self._reload = None
            self._skip = self.accumulate.micro_step
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        self._window_items = float(sum(self.count_items(b) for b in batches[self._skip :]))
        return batches, None

    def count_items(self, inputs: Mapping[str, Any]) -> int:
        """How many items the micro-batch's mean loss averages over (the weight it gets).

        Args: inputs: the micro-batch (a dict of tensors, as the collator returns it).
        Returns: an int >= 0: the labels other than -100 in ``shift_labels`` if present, else in
            ``labels`` (``labels[..., 1:]`` if the loss shifts, see ``shift_labels``); without
            labels, the rows (dim 0 of the first tensor). Override it for other losses.
        Raises: ValueError: the micro-batch holds no tensor; the labels' shift cannot be read
            from the model (``_hf_loss.AMBIGUOUS_SHIFT``: say ``shift_labels``).
        """
        labels = inputs.get("shift_labels")
        if labels is None and inputs.get("labels") is not None:
            labels = inputs["labels"]
            labels = labels[..., 1:] if self._shifts() else labels
        if isinstance(labels, Tensor):
            return int((labels != _IGNORE_INDEX).sum())
        for value in inputs.values():
            if isinstance(value, Tensor) and value.dim() > 0:
                return int(value.shape[0])
        raise ValueError("AccumulateTrainer.count_items: the micro-batch holds no tensor.")

    def _shifts(self) -> bool:
        if self.shift_labels is not None:
            return self.shift_labels
        model = self.accelerator.unwrap_model(self.model)
        if self.label_smoother is not None and self.compute_loss_func is None:
            return smoother_shifts(model)  # the smoother's loss, shifted by its own rule
        guess = bool(getattr(self, "_loss_shifts_labels", False))
        return loss_shifts(model, guess, self._own_loss())

    def _own_loss(self) -> bool:
        """Whether the user computes the loss, not the model: ``compute_loss_func``, or an
        overridden ``compute_loss``."""
        own = self.compute_loss_func is not None
        return own or type(self).compute_loss is not Trainer.compute_loss

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """One micro-step: the micro-batch's summed loss, weighted by its items.

        Args:
            model: the (possibly DDP-wrapped) model. inputs: the micro-batch.
            num_items_in_batch: ignored (the wrapper divides by the window's items).

        Returns:
            A 0-dim tensor for the Trainer's logged loss: the micro-batch's summed loss over
            this rank's items in the Trainer's window (its share of the window's mean).
        """
        if self._skip > 0:  # held by the window a resumed checkpoint brought back
            self._skip -= 1
            return torch.zeros((), device=self.args.device)
        self._adopt(model)
        model.train()
        inputs = self._prepare_inputs(inputs)
        n = self.count_items(inputs)
        with self.compute_loss_context_manager():
            if n > 0:  # the mean over the micro-batch's items (the Trainer's loss), times n
                loss_sum: Tensor = self.compute_loss(model, inputs) * n  # type: ignore[assignment]
            else:  # a mean over no item is NaN: backpropagate an exact zero instead
                _, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss_sum = zero_loss(outputs, self.accumulate)
        self.accumulate.next_items(n)
        self.accelerator.backward(loss_sum)
        shown: Tensor = loss_sum.detach() / max(self._window_items, float(n), 1.0)
        return shown

    def _clip_grad_norm(self, model: nn.Module) -> None:
        return None  # the wrapper clips the window's gradient once, at the update

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Tensor:
        self._norm = torch.full((), float("nan"), device=self.args.device)
        return self._norm  # filled by Boundary.step: the window's pre-clip norm

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        write = super()._save_optimizer_and_scheduler
        window_file.save(
            self.accumulate, output_dir, self.args.process_index, lambda: write(output_dir)
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._adopt(self.model_wrapped)
        main: list[tuple[Any, int]] = []  # optimizer.pt's position (its window: not loaded)
        hook = self.accumulate.register_load_state_dict_pre_hook(
            lambda _, state: window_file.without_window(state, main)
        )
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            hook.remove()
        if checkpoint is None:
            return
        where = "cpu" if self.args.device.type == "cpu" else self.args.device  # not cpu:0
        # applied once the Trainer has zeroed the gradients (get_batch_samples)
        ranks = self.accumulate._ranks  # under DDP: the ranks agree through accumopt's group
        agree = None if ranks is None else ranks.failed_ranks
        self._reload = window_file.resume(checkpoint, self.args.process_index, main, where, agree)

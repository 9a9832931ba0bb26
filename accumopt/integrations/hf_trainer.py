"""The Hugging Face ``transformers.Trainer`` with accumopt (``examples/hf_trainer_charlm.py``)::

    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=3e-4), every=8)
    trainer = AccumulateTrainer(model=model, args=args, train_dataset=ds,
                                data_collator=collate, optimizers=(opt, None))
    trainer.train()  # an update per 8 micro-batches: the mean over all their items

The Trainer's batch is the micro-batch and its windows are the wrapper's, so ``global_step``,
logging, saving and the LR schedule count updates; an epoch's short last window is applied. A
plain ``Trainer`` cannot use an ``Accumulate``: it clears the gradients after each of its steps
(refused at the next micro-step: a run of one micro-batch ends with no update) and divides each
loss by its own ``gradient_accumulation_steps`` (which accumopt does not see).
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from accumopt import Accumulate
from accumopt.distributed import is_distributed
from accumopt.integrations import _hf_loss
from accumopt.integrations import _hf_window_file as window_file


class TransformersMissing(ImportError):
    """Raised on import without transformers and accelerate."""


try:
    from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped, import-not-found, unused-ignore]
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise TransformersMissing(
        'accumopt.integrations.hf_trainer needs: pip install "accumopt[transformers]".'
    ) from err

__all__ = ["WINDOW_FILE", "AccumulateTrainer", "TransformersMissing", "check_trainer_hooks"]
WINDOW_FILE = window_file.WINDOW_FILE
_LOG = logging.getLogger("accumopt")
_DROPPED = (
    "AccumulateTrainer.train: dropped the open window of %d micro-step(s): a training that does "
    "not resume starts afresh. To keep it, resume from the checkpoint it was saved in."
)
_HOOKS = (  # noqa: SIM905
    "training_step compute_loss get_batch_samples create_optimizer _prepare_for_training "
    "_clip_grad_norm _get_grad_norm _save_optimizer_and_scheduler _load_optimizer_and_scheduler "
    "_save_checkpoint create_accelerator_and_postprocess"
).split()


def check_trainer_hooks(trainer_cls: type) -> None:
    """Raise ImportError naming the methods :class:`AccumulateTrainer` overrides or calls that
    ``trainer_cls`` lacks (another transformers than 5.x)."""
    missing = [name for name in _HOOKS if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise ImportError(
            f"accumopt.integrations.hf_trainer: {trainer_cls.__qualname__} has no "
            f"{', '.join(missing)}; expected the transformers 5.x Trainer (tested on 5.24)."
        )


check_trainer_hooks(Trainer)


class AccumulateTrainer(Trainer):
    """``transformers.Trainer`` stepping an :class:`~accumopt.Accumulate` once per window.

    Args: as ``Trainer``'s; ``optimizers=(opt, scheduler)``, ``opt`` an ``Accumulate(...,
    every=k)`` or a torch optimizer or None (the Trainer's), then wrapped with ``every=
    args.gradient_accumulation_steps``. ``shift_labels``: whether the loss predicts
    ``labels[..., 1:]`` (:meth:`count_items`); None: read from the model.

    ``args`` becomes a copy with ``gradient_accumulation_steps = k``; the wrapper clips to
    ``args.max_grad_norm`` unless it has its own norm. The logged ``grad_norm`` is the
    window's pre-clip norm, in the parameters' dtype. A checkpoint written mid-window keeps
    each rank's window (:data:`WINDOW_FILE`) and resumes bit for bit.

    Raises: TypeError (not an optimizer); ValueError (a window not ``every=<int>``, another
    ``gradient_accumulation_steps``, two clipping norms); RuntimeError at ``train()``
    (:meth:`check_supported`, ``gradient_accumulation_steps`` changed, an update from inside
    the Trainer's window, a mid-window checkpoint without this rank's window file).
    """

    def __init__(self, *args: Any, shift_labels: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shift_labels = shift_labels
        self._norm: Tensor | None = None  # the logged grad_norm, filled at the update
        self._window_items = 0.0  # this rank's items in the Trainer's window (logging)
        self._stepping = False  # inside _Boundary.step
        self._checked: Accumulate | None = None  # the wrapper whose window _wrap checked
        self._hook: Any = None  # on it while train() runs: no update but the Trainer's
        self._skip = 0  # micro-batches of a resumed window that the loaded window holds
        self._reload: dict[str, Any] | None = None  # that window, loaded at the first batch
        if self.optimizer is not None:
            self.optimizer = self.callback_handler.optimizer = self._wrap(self.optimizer)

    @property
    def accumulate(self) -> Accumulate:
        """The wrapper the Trainer steps (RuntimeError before the optimizer exists)."""
        if (opt := _find(self.optimizer)) is None:
            raise RuntimeError("AccumulateTrainer: no optimizer yet; expected train() first.")
        return opt

    def _wrap(self, given: Any) -> Any:
        """``given`` if it holds an ``Accumulate``, else one around it; reconciled with args."""
        steps, opt = int(self.args.gradient_accumulation_steps), _find(given)
        if opt is None:  # TypeError if not an optimizer
            given = opt = Accumulate(given, every=steps)
        if opt is not self._checked:
            if _fixed_every(opt) is None:
                raise ValueError(
                    f"AccumulateTrainer: {opt!r} has a window in items or a schedule; expected "
                    "every=<int>: the Trainer cuts each window's micro-batches in advance."
                )
            self._checked = opt
        every = int(opt.every or 0)
        if steps not in (1, every):
            raise ValueError(
                f"AccumulateTrainer: args.gradient_accumulation_steps={steps} but the wrapper "
                f"has every={every}; expected 1 (then set to {every}) or {every}."
            )
        if steps != every:
            self.args = copy.copy(self.args)  # the caller's args stay as they were
            self.args.gradient_accumulation_steps = every
        opt.driven_by = type(self).__qualname__  # the Trainer's windows are the wrapper's
        clip = float(self.args.max_grad_norm or 0.0)
        if opt.max_grad_norm is None:
            opt.max_grad_norm = clip if clip > 0 else float("inf")
        elif clip > 0 and opt.max_grad_norm != clip:
            raise ValueError(
                f"AccumulateTrainer: Accumulate(max_grad_norm={opt.max_grad_norm}) and "
                f"TrainingArguments(max_grad_norm={clip}) differ; set args.max_grad_norm=0."
            )
        return given

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        self.optimizer = self._wrap(super().create_optimizer(model))
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # the wrapper decides which pass syncs:
        self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True

    def check_supported(self) -> None:
        """Run by :meth:`train`: RuntimeError for what the wrapper cannot own or weight
        (``_hf_loss.loss_refusal``), UserWarning for a per-micro-batch auxiliary loss."""
        model, own_loss = self.accelerator.unwrap_model(self.model), self._own_loss()
        own_count = type(self).count_items is not AccumulateTrainer.count_items
        if (refusal := _hf_loss.loss_refusal(model, own_count, own_loss)) is not None:
            raise RuntimeError(refusal)
        if not own_loss and (aux := _hf_loss.aux_loss_warning(model)) is not None:
            warnings.warn(aux, UserWarning, stacklevel=3)
        problems = {
            "DeepSpeed/FSDP": self.is_deepspeed_enabled or self.is_fsdp_enabled,
            "fp16 with a GradScaler (use bf16)": getattr(self.accelerator, "scaler", None),
            "DataParallel (use DDP)": self.args.n_gpu > 1,
            "context/sequence parallelism": self.get_cp_size() * self.get_sp_size() > 1,
            "auto_find_batch_size": self.args.auto_find_batch_size,
        }
        if found := [name for name, on in problems.items() if on]:
            raise RuntimeError(
                f"AccumulateTrainer: not supported: {'; '.join(found)}; expected a single "
                "device or DDP (torchrun), fp32/bf16."
            )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; without ``resume_from_checkpoint`` an open window is dropped (with
        a warning), as the Trainer drops a partial accumulation."""
        self.check_supported()
        self._skip, self._reload = 0, None
        resume = args[0] if args else kwargs.get("resume_from_checkpoint")
        opt = _find(self.optimizer)
        if not resume and opt is not None and (n := opt.micro_step):
            _LOG.warning(_DROPPED, n)
            opt.discard()
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._hook is not None:
                self._hook.remove()
            self._hook = None

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        model, loader = super()._prepare_for_training(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._adopt(model)
        if self._hook is None:
            self._hook = self.accumulate.register_step_pre_hook(self._only_at_boundary)
        prepared = self.optimizer
        if isinstance(prepared, AcceleratedOptimizer) and not isinstance(
            prepared.optimizer, _Boundary
        ):
            prepared.optimizer = _Boundary(self)
        return model, loader

    def _only_at_boundary(self, opt: Accumulate, *_: Any) -> None:
        if opt.will_update and not self._stepping:
            raise RuntimeError(
                "AccumulateTrainer: the wrapper was about to update inside the Trainer's window "
                "(stepped in training_step, e.g. by a MicroBatchRunner); nothing was applied. "
                "Let the Trainer cut and step the micro-batches."
            )

    def _adopt(self, model: nn.Module) -> None:
        """Give the wrapper the DDP module the Trainer wrapped the model in."""
        if is_distributed(model) and self.accumulate.model is not model:
            self.accumulate.set_model(model)

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], None]:
        """The Trainer's window; no ``num_items_in_batch`` (the wrapper counts the items)."""
        opt, steps = self.accumulate, self.args.gradient_accumulation_steps
        if steps != opt.every:
            raise RuntimeError(
                f"AccumulateTrainer: args.gradient_accumulation_steps changed to {steps}; "
                f"expected the wrapper's every={opt.every}. Build the trainer anew."
            )
        if self._reload is not None:  # after the Trainer's model.zero_grad() at the start
            opt.load_state_dict(self._reload)
            self._reload, self._skip = None, opt.micro_step
        batches = list(itertools.islice(epoch_iterator, num_batches))
        self._window_items = float(sum(self.count_items(b) for b in batches[self._skip :]))
        return batches, None

    def count_items(self, inputs: Mapping[str, Any]) -> int:
        """The items the micro-batch's mean loss averages over (its weight): the labels other
        than -100 in ``shift_labels``, else in ``labels`` (``[..., 1:]`` where the loss shifts);
        else the rows. Override it for other losses. ValueError: no tensor; a label shift the
        model does not tell (``_hf_loss.AMBIGUOUS_SHIFT``)."""
        labels = inputs.get("shift_labels")
        if labels is None and inputs.get("labels") is not None:
            labels = inputs["labels"][..., 1:] if self._shifts() else inputs["labels"]
        if isinstance(labels, Tensor):
            return int((labels != -100).sum())
        for value in inputs.values():
            if isinstance(value, Tensor) and value.dim() > 0:
                return int(value.shape[0])
        raise ValueError("AccumulateTrainer.count_items: the micro-batch holds no tensor.")

    def _shifts(self) -> bool:
        if self.shift_labels is not None:
            return self.shift_labels
        model = self.accelerator.unwrap_model(self.model)
        if self.label_smoother is not None and self.compute_loss_func is None:
            return _hf_loss.smoother_shifts(model)
        guess = bool(getattr(self, "_loss_shifts_labels", False))
        return _hf_loss.loss_shifts(model, guess, self._own_loss())

    def _own_loss(self) -> bool:  # the user's compute_loss_func, or compute_loss overridden
        own = self.compute_loss_func is not None
        return own or type(self).compute_loss is not Trainer.compute_loss

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """One micro-step: the mean loss times its items; returns (for the Trainer's log) this
        rank's share of the window's mean loss."""
        self.optimizer.train()  # type: ignore[union-attr]  # schedule-free: its training point
        if self._skip > 0:  # held by the window a resumed checkpoint brought back
            self._skip -= 1
            return torch.zeros((), device=self.args.device)
        model.train()
        inputs = self._prepare_inputs(inputs)
        n, opt = self.count_items(inputs), self.accumulate
        with self.compute_loss_context_manager():
            if n > 0:
                loss_sum: Tensor = self.compute_loss(model, inputs) * n  # type: ignore[assignment]
            else:  # a mean over no item is NaN: backpropagate an exact zero instead
                _, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss_sum = _hf_loss.zero_loss(outputs, _params(opt))
        opt.next_items(n)
        self.accelerator.backward(loss_sum)
        shown: Tensor = loss_sum.detach() / max(self._window_items, float(n), 1.0)
        return shown

    def _clip_grad_norm(self, model: nn.Module) -> None:  # the wrapper clips, at the update
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Tensor:
        dtypes = [p.dtype for p in _params(self.accumulate)]
        dtype = functools.reduce(torch.promote_types, dtypes, torch.float32)
        self._norm = torch.full((), float("nan"), dtype=dtype, device=self.args.device)
        return self._norm  # filled by _Boundary.step: the window's pre-clip norm

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        write = super()._save_optimizer_and_scheduler
        rank = self.args.process_index
        window_file.save(self.accumulate, output_dir, rank, lambda: write(output_dir))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._adopt(self.model_wrapped)
            where = "cpu" if self.args.device.type == "cpu" else self.args.device
            load = functools.partial(super()._load_optimizer_and_scheduler, checkpoint)
            rank, opt = self.args.process_index, self.accumulate
            self._reload = window_file.resume(opt, checkpoint, rank, where, load)


class _Boundary:
    """What ``AcceleratedOptimizer`` steps: the wrapper, or an epoch's short last window
    flushed; anything else is the wrapper's."""

    def __init__(self, trainer: AccumulateTrainer) -> None:
        self.trainer, self.optimizer = trainer, trainer.accumulate

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # during copy/unpickling, before __init__
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def step(self, closure: Any = None) -> None:
        opt, trainer = self.optimizer, self.trainer
        trainer._stepping = True
        try:
            if opt.will_update:
                opt.step()
            elif opt.micro_step:
                opt.flush()
        finally:
            trainer._stepping = False
        report, norm = opt.last_window, trainer._norm
        if norm is not None and report is not None and report.grad_norm is not None:
            norm.copy_(report.grad_norm)


def _find(opt: Any) -> Accumulate | None:
    """The ``Accumulate`` in ``opt`` (under Accelerate's wrapper), or None."""
    while opt is not None and not isinstance(opt, Accumulate):
        opt = getattr(opt, "optimizer", None)
    return opt


def _params(opt: Accumulate) -> list[Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _fixed_every(opt: Accumulate) -> int | None:
    """The wrapper's ``every`` if fixed (its checkpoint entry holds it only then), or None."""
    group = opt.state_dict()["param_groups"][0]
    packed = next(v for k, v in group.items() if str(k).startswith("accumopt"))
    every = torch.load(io.BytesIO(packed), weights_only=True)["every"]
    return every if isinstance(every, int) else None

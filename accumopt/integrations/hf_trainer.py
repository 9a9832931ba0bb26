"""The Hugging Face ``transformers.Trainer`` with accumopt: :class:`AccumulateTrainer` (docs/
frameworks/hf-trainer.md, ``examples/hf_trainer_charlm.py``)."""

from __future__ import annotations

import copy
import functools
import inspect
import io
import itertools
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from accumopt import Accumulate, checkpoint_position
from accumopt.distributed import is_distributed

try:
    from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped, import-not-found, unused-ignore]
    from transformers import PreTrainedModel, Trainer, trainer_utils
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError as err:  # pragma: no cover - depends on the environment
    msg = 'accumopt.integrations.hf_trainer needs: pip install "accumopt[transformers]".'
    raise ImportError(msg) from err

__all__ = ["WINDOW_FILE", "AccumulateTrainer", "check_trainer_hooks"]
WINDOW_FILE = "accumopt_window_rank{rank}.pt"
"""Each rank's ``opt.state_dict()`` beside a mid-window checkpoint's ``optimizer.pt`` (rank 0's)."""
_LOG = logging.getLogger("accumopt")
_HOOKS = (  # noqa: SIM905
    "training_step compute_loss get_batch_samples create_optimizer _prepare_for_training "
    "_clip_grad_norm _get_grad_norm _save_optimizer_and_scheduler _load_optimizer_and_scheduler "
    "_save_checkpoint create_accelerator_and_postprocess"
).split()
_MEAN_OVER_LABELS = (  # noqa: SIM905
    "ForCausalLM ForConditionalGeneration ForMaskedLM ForTokenClassification ForQuestionAnswering "
    "ForSequenceClassification ForImageClassification ForVideoClassification ForAudioClassification"
).split()
_NOT_LABEL_MEANS = ("Musicgen", "MusicgenMelody", "MoshiForConditionalGeneration")  # any loss_type
_OWN_LOSS = re.compile(r"\bloss\w*\s*=|cross_entropy|CrossEntropyLoss|nll_loss|NLLLoss")


def check_trainer_hooks(trainer_cls: type) -> None:
    """ImportError naming the methods :class:`AccumulateTrainer` uses that ``trainer_cls`` lacks."""
    missing = [name for name in _HOOKS if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise ImportError(
            f"accumopt.integrations.hf_trainer: {trainer_cls.__qualname__} has no "
            f"{', '.join(missing)}; expected the transformers 5.x Trainer (tested on 5.24)."
        )


check_trainer_hooks(Trainer)


class AccumulateTrainer(Trainer):
    """``transformers.Trainer`` stepping an :class:`~accumopt.Accumulate` once per window, the
    epoch's short last one too (docs/frameworks/hf-trainer.md).

    Args: as ``Trainer``'s; ``optimizers=(opt, scheduler)``, ``opt`` an ``Accumulate(...,
    every=k)`` (``args`` becomes a copy with ``gradient_accumulation_steps=k``), or a torch
    optimizer or None wrapped with ``every=args.gradient_accumulation_steps``.
    ``shift_labels``: whether the loss predicts ``labels[..., 1:]``; None: read from the model.

    Raises: TypeError (not an optimizer); ValueError (not ``every=<int>``, another
    ``gradient_accumulation_steps``, two clipping norms); RuntimeError at ``train()``
    (:meth:`check_supported`, ``gradient_accumulation_steps`` changed, an update inside the
    Trainer's window, a mid-window checkpoint without this rank's :data:`WINDOW_FILE` or from
    another save).
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
        self._resumed_from = ""  # the checkpoint it came from (its RNG state)
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
        if opt is not self._checked:  # the checkpoint entry holds an int only for a fixed every
            group = opt.state_dict()["param_groups"][0]
            packed = next(v for k, v in group.items() if str(k).startswith("accumopt"))
            if not isinstance(torch.load(io.BytesIO(packed), weights_only=True)["every"], int):
                msg = f"{opt!r} has a window in items or a schedule; expected every=<int>."
                raise ValueError(f"AccumulateTrainer: {msg}")
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
        """Run by :meth:`train`: RuntimeError for what the wrapper cannot own or weight,
        UserWarning for a loss of each micro-batch as a whole (a MoE router's)."""
        model, own_loss = self.accelerator.unwrap_model(self.model), self._own_loss()
        own_count = type(self).count_items is not AccumulateTrainer.count_items
        if (refusal := _loss_refusal(model, own_count, own_loss)) is not None:
            raise RuntimeError(refusal)
        config = getattr(model, "config", None)
        router = bool(getattr(config, "output_router_logits", False))
        names = ["router_aux_loss_coef", "router_z_loss_coef"] if router else []
        values = {k: getattr(config, k, None) for k in [*names, "z_loss_coefficient"]}
        aux = [f"{k}={v!r}" for k, v in values.items() if v]
        if router and not hasattr(config, "router_aux_loss_coef"):
            aux.append("output_router_logits=True")
        if aux and not own_loss:
            msg = f"{type(model).__name__} adds an auxiliary loss of each micro-batch as a whole"
            end = "so no accumulation gives the full-batch update. Set it to 0 to be exact."
            warnings.warn(f"AccumulateTrainer: {msg} ({', '.join(aux)}), {end}", stacklevel=3)
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
        """``Trainer.train``; without ``resume_from_checkpoint`` an open window is dropped."""
        self.check_supported()
        self._skip, self._reload = 0, None
        resume = args[0] if args else kwargs.get("resume_from_checkpoint")
        opt = _find(self.optimizer)
        if not resume and opt is not None and (n := opt.micro_step):
            msg = "AccumulateTrainer.train: dropped the open window of %d micro-step(s) (not "
            _LOG.warning(msg + "resuming); to keep it, resume from its checkpoint.", n)
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
        if isinstance(prepared, AcceleratedOptimizer) and type(prepared.optimizer) is not _Boundary:
            prepared.optimizer = _Boundary(self)
        return model, loader

    def _only_at_boundary(self, opt: Accumulate, *_: Any) -> None:
        if opt.will_update and not self._stepping:
            raise RuntimeError(
                "AccumulateTrainer: the wrapper was about to update inside the Trainer's window "
                "(a MicroBatchRunner in training_step?); nothing was applied. Let the Trainer step."
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
        reload, self._reload = self._reload, None
        if reload is not None:  # after the Trainer's model.zero_grad() at the start
            opt.load_state_dict(reload)
            self._skip = opt.micro_step
        batches = list(itertools.islice(epoch_iterator, num_batches))
        if 0 < len(batches) < num_batches:  # a stream that ended: the Trainer steps no window
            raise RuntimeError(  # that falls short of what it asked for (a sized one, it does)
                f"AccumulateTrainer: the training data ended {len(batches)} micro-batch(es) into "
                f"a window of {num_batches} (an IterableDataset), which the Trainer does not "
                "step; nothing of it was run. Make the stream's length a multiple of "
                "per_device_train_batch_size x gradient_accumulation_steps, or use a sized dataset."
            )
        if reload is not None:  # the saved RNG state follows the window's fetch (the Trainer
            self._load_rng_state(self._resumed_from)  # restores it before an epoch's first)
        self._window_items = float(sum(self.count_items(b) for b in batches[self._skip :]))
        return batches, None

    def count_items(self, inputs: Mapping[str, Any]) -> int:
        """The items the micro-batch's mean loss averages over: the labels other than -100 in
        ``shift_labels``, else in ``labels`` (``[..., 1:]`` where the loss shifts); else the rows.
        Override it for other losses. ValueError: no tensor; a label shift the model hides."""
        labels = inputs.get("shift_labels")
        if labels is None and inputs.get("labels") is not None:
            labels = inputs["labels"]  # per-token labels may be shifted by the loss
            if isinstance(labels, Tensor) and labels.dim() > 1 and self._shifts():
                labels = labels[..., 1:]
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
        guess = bool(getattr(self, "_loss_shifts_labels", False))
        smoother = self.label_smoother is not None and self.compute_loss_func is None
        return _loss_shifts(model, guess, self._own_loss(), smoother)

    def _own_loss(self) -> bool:  # the user's compute_loss_func, or compute_loss overridden
        own = self.compute_loss_func is not None
        return own or type(self).compute_loss is not Trainer.compute_loss

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """One micro-step: the mean loss times its items; returns this rank's share (logged)."""
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
            else:  # a mean over no item is NaN: backpropagate an exact zero through the outputs
                _, outputs = self.compute_loss(model, inputs, return_outputs=True)
                pairs = outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs)
                found = [v for k, v in pairs if k not in ("loss", 0) and isinstance(v, Tensor)]
                found = [t for t in found if t.requires_grad] or _params(opt)  # DDP: a full pass
                loss_sum = sum((t.nan_to_num().sum() * 0.0 for t in found), found[0].new_zeros(()))
        opt.next_items(n)
        self.accelerator.backward(loss_sum)
        return loss_sum.detach() / max(self._window_items, float(n), 1.0)

    def _clip_grad_norm(self, model: nn.Module) -> None:  # the wrapper clips, at the update
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Tensor:
        dtypes = [p.dtype for p in _params(self.accumulate)]
        dtype = functools.reduce(torch.promote_types, dtypes, torch.float32)
        self._norm = torch.full((), float("nan"), dtype=dtype, device=self.args.device)
        return self._norm  # filled by _Boundary.step: the window's pre-clip norm

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's save, then this rank's window file if a window is open (old removed)."""
        opt = self.accumulate
        path = os.path.join(output_dir, WINDOW_FILE.format(rank=self.args.process_index))
        if os.path.isfile(path):
            os.remove(path)
        super()._save_optimizer_and_scheduler(output_dir)
        if opt.micro_step > 0:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(opt.state_dict(), path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._adopt(self.model_wrapped)
            where = "cpu" if self.args.device.type == "cpu" else self.args.device
            load = functools.partial(super()._load_optimizer_and_scheduler, checkpoint)
            rank, opt = self.args.process_index, self.accumulate
            self._reload = _resume_window(opt, checkpoint, rank, where, load)
            self._resumed_from = checkpoint


class _Boundary:
    """What ``AcceleratedOptimizer`` steps: the wrapper, or its short last window flushed."""

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


def _loss_refusal(model: Any, own_count: bool, own_loss: bool) -> str | None:
    """Why the loss of ``model`` (unwrapped) is no mean over what ``count_items`` counts; None
    if it is, or the user counts the items (``own_count``) or computes the loss (``own_loss``)."""
    if own_count or own_loss:
        return None
    loss_type = getattr(model, "loss_type", None)
    if type(model).__name__.startswith(_NOT_LABEL_MEANS):
        loss_type = f"{loss_type}, but its own loss code"
    elif loss_type is None or loss_type in _MEAN_OVER_LABELS:
        return None
    return (
        f"AccumulateTrainer: the model's loss ({type(model).__name__}, loss_type {loss_type!r}) "
        "is no mean over its labels other than -100, so weighting by them would be silently "
        "wrong. Override count_items to return what it averages over, or pass compute_loss_func."
    )


def _loss_shifts(model: Any, trainer_guess: bool, own_loss: bool, smoother: bool = False) -> bool:
    """Whether the loss of ``model`` (unwrapped; a PEFT model's inner one) predicts
    ``labels[..., 1:]`` (the rules: docs/frameworks/hf-trainer.md). ValueError: loss code of
    the model's own under a causal-LM name."""
    if trainer_utils._is_peft_model(model):  # type: ignore[no-untyped-call]
        model = model.base_model.model
    if smoother:
        return model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    if own_loss or "_loss_function" in vars(model):
        return trainer_guess or causal
    if _through_loss_function(model.__class__):
        loss = LOSS_MAPPING.get(getattr(model, "loss_type", None) or "", ForCausalLMLoss)
        return loss is ForCausalLMLoss
    if causal or trainer_guess or not isinstance(model, PreTrainedModel):
        where = "under a causal-LM name" if causal or trainer_guess else "outside transformers"
        raise ValueError(
            f"AccumulateTrainer: {type(model).__name__}'s own loss code, {where}: cannot tell "
            "whether the loss predicts labels[..., 1:] (the micro-batch's weight). Pass "
            "AccumulateTrainer(..., shift_labels=True/False)."
        )
    return False


@functools.cache
def _through_loss_function(cls: Any) -> bool:
    """Whether ``cls.forward`` calls ``self.loss_function`` (maybe through ``super().forward``)."""
    for forward in filter(None, [vars(klass).get("forward") for klass in cls.__mro__]):
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            return False
        if "self.loss_function" in source:
            return True
        if "super().forward(" not in source or _OWN_LOSS.search(source):
            return False
    return False


def _resume_window(
    opt: Accumulate, checkpoint: str, rank: int, device: Any, load_main: Callable[[], None]
) -> Any:
    """Run ``load_main`` (loads ``optimizer.pt`` without its window), then return this rank's
    window file if saved at the same ``checkpoint_position``, else None (logged). RuntimeError
    on every rank: a rank's file missing beside a mid-window ``optimizer.pt``, or from another
    save."""
    seen: list[tuple[int, int]] = []

    def without_window(_: Any, state: Any) -> Any:  # optimizer.pt mid-window: its window dropped
        if (position := checkpoint_position(state)) is not None:
            seen.append(position)
        if position is None or position[1] == 0:
            return None
        groups = state["param_groups"]
        first = {k: v for k, v in groups[0].items() if not str(k).startswith("accumopt")}
        return {**state, "param_groups": [first, *groups[1:]]}

    hook = opt.register_load_state_dict_pre_hook(without_window)
    try:
        load_main()
    finally:
        hook.remove()
    main, path = seen[0] if seen else None, os.path.join(checkpoint, WINDOW_FILE.format(rank=rank))
    saved, problem, ignored = None, None, "AccumulateTrainer: ignored %s: %s; resuming without it."
    if not os.path.isfile(path):
        if main is not None and main[1] > 0:
            problem = f"{checkpoint} was written mid-window but has no {path} (this rank's window)"
    elif main is None:
        _LOG.warning(ignored, path, "no optimizer.pt with accumopt's state beside it to match it")
    else:
        saved = torch.load(path, map_location=device, weights_only=True)
        if (mine := checkpoint_position(saved)) != main:
            saved = None
            if main[1] == 0:
                _LOG.warning(ignored, path, "it is left over from an earlier save (at an update)")
            else:
                problem = f"{path} ({mine}) and optimizer.pt ({main}) come from different saves"
    refused, _ = opt.sum_over_ranks(problem is not None, what="AccumulateTrainer's resume")
    if problem is None and refused:
        problem = f"another rank refused the window files of {checkpoint} (its error says why)"
    if problem is not None:
        raise RuntimeError(f"AccumulateTrainer: {problem}; resume from another checkpoint.")
    return saved

"""Whether a Hugging Face model's loss is the mean over the items ``AccumulateTrainer``
weights a micro-batch by (its labels other than -100, or its rows), and which labels count."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

MEAN_OVER_LABELS = frozenset(
    "ForCausalLM ForConditionalGeneration ForMaskedLM ForTokenClassification "  # noqa: SIM905
    "ForSequenceClassification ForImageClassification ForVideoClassification "
    "ForAudioClassification ForQuestionAnswering".split()
)
NOT_LABEL_MEANS = ("Musicgen", "MusicgenMelody", "MoshiForConditionalGeneration")
"""Class names whose own loss is no such mean, whatever their ``loss_type``."""

UNKNOWN_LOSS = (
    "AccumulateTrainer: the model's loss ({model}, loss_type {loss_type!r}) is no mean over its "
    "labels other than -100, so weighting micro-batches by them would be silently wrong; "
    "expected a loss type among {known}. Override count_items to return what the loss is a "
    "mean over (the rows for ctc_loss_reduction='mean'), or pass a compute_loss_func."
)
AUX_LOSS = (
    "AccumulateTrainer: {model} adds an auxiliary loss of each micro-batch as a whole ({what}), "
    "so no accumulation gives the full-batch update. Set it to 0 for exact accumulation."
)
AMBIGUOUS_SHIFT = (
    "AccumulateTrainer: {model} computes its loss in code of its own under a causal-LM name, so "
    "accumopt cannot tell whether the loss predicts labels[..., 1:] (which decides the "
    "micro-batch's weight). Pass AccumulateTrainer(..., shift_labels=True/False)."
)


def loss_refusal(model: Any, own_count: bool, own_loss: bool) -> str | None:
    """Why the loss of ``model`` (unwrapped) cannot be weighted by ``count_items``, or None
    (``own_count``, ``own_loss``: the user overrides one or computes the other)."""
    if own_count or own_loss:
        return None
    loss_type = getattr(model, "loss_type", None)
    if type(model).__name__.startswith(NOT_LABEL_MEANS):
        loss_type = f"{loss_type}, but its own loss code"
    elif loss_type is None or loss_type in MEAN_OVER_LABELS:
        return None
    known = ", ".join(sorted(MEAN_OVER_LABELS))
    return UNKNOWN_LOSS.format(model=type(model).__name__, loss_type=loss_type, known=known)


def aux_loss_warning(model: Any) -> str | None:
    """The warning for a config that adds a per-micro-batch loss (a MoE router's), or None."""
    config = getattr(model, "config", None)
    router = bool(getattr(config, "output_router_logits", False))
    names = ["router_aux_loss_coef", "router_z_loss_coef"] if router else []
    values = {k: getattr(config, k, None) for k in [*names, "z_loss_coefficient"]}
    found = [f"{k}={v!r}" for k, v in values.items() if v]
    if router and not hasattr(config, "router_aux_loss_coef"):
        found.append("output_router_logits=True")
    return AUX_LOSS.format(model=type(model).__name__, what=", ".join(found)) if found else None


def zero_loss(outputs: Any, params: list[Tensor]) -> Tensor:
    """An exact zero through the outputs but the loss (or ``params``): a normal pass for DDP."""
    pairs = outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs)
    tensors = [v for k, v in pairs if k not in ("loss", 0) and isinstance(v, Tensor)]
    tensors = [t for t in tensors if t.requires_grad] or params
    return sum((t.nan_to_num().sum() * 0.0 for t in tensors), tensors[0].new_zeros(()))


def smoother_shifts(model: Any) -> bool:
    """Whether the Trainer's label smoother shifts the labels: for causal-LM class names only."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return _unpeft(model)._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _unpeft(model: Any) -> Any:
    """The model a PEFT wrapper wraps, else ``model``."""
    from transformers.trainer_utils import _is_peft_model

    return model.base_model.model if _is_peft_model(model) else model  # type: ignore[no-untyped-call]


def loss_shifts(model: Any, trainer_guess: bool, own_loss: bool) -> bool:
    """Whether the loss of ``model`` (unwrapped) predicts ``labels[..., 1:]``: never for an
    encoder-decoder; for the user's loss, the Trainer's guess or a causal-LM name; for
    ``self.loss_function``, its ``loss_type`` (None: causal LM). Loss code of the model's own
    under a causal-LM name: ValueError :data:`AMBIGUOUS_SHIFT`."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    model = _unpeft(model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    if own_loss or "_loss_function" in vars(model):
        return trainer_guess or causal
    if _through_loss_function(model.__class__):
        loss = LOSS_MAPPING.get(getattr(model, "loss_type", None) or "", ForCausalLMLoss)
        return loss is ForCausalLMLoss
    if causal or trainer_guess:
        raise ValueError(AMBIGUOUS_SHIFT.format(model=type(model).__name__))
    return False


_OWN_LOSS = re.compile(r"\bloss\w*\s*=|cross_entropy|CrossEntropyLoss|nll_loss|NLLLoss")


@functools.cache
def _through_loss_function(cls: Any) -> bool:
    """Whether ``cls.forward`` calls ``self.loss_function`` (through ``super().forward`` in
    overrides without loss code of their own)."""
    for klass in cls.__mro__:
        forward = vars(klass).get("forward")
        if forward is None:
            continue
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            return False
        if "self.loss_function" in source:
            return True
        if "super().forward(" not in source or _OWN_LOSS.search(source):
            return False
    return False

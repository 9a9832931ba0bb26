"""Whether a Hugging Face model's loss is what :class:`AccumulateTrainer` weights it as.

``AccumulateTrainer.count_items`` weights a micro-batch by its labels other than -100 (or its
rows): exact when the model's loss is the mean over those items. That holds for the loss
types of ``transformers.loss.loss_utils.LOSS_MAPPING`` listed in :data:`MEAN_OVER_LABELS`
(token or row means with ``ignore_index=-100``); others are sums or means over something
else (``ForCTC``: a sum, or a mean of per-sequence means; ``ForRNNT``/``ForTDT``, detection,
segmentation: their own normalisations), and would train silently wrong. A model without a
``loss_type`` (a plain ``nn.Module``, or a model the name lookup left without one, such as
``GPT2LMHeadModel``, which then uses the causal-LM loss) is taken at its word: its loss is
assumed to be a mean over the items ``count_items`` counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from accumopt._grads import params_of

MEAN_OVER_LABELS = frozenset(
    {
        "ForCausalLM",
        "ForConditionalGeneration",
        "ForMaskedLM",
        "ForTokenClassification",
        "ForSequenceClassification",
        "ForImageClassification",
        "ForVideoClassification",
        "ForAudioClassification",
        "ForQuestionAnswering",
    }
)
"""``loss_type`` values whose loss is a mean over the labels other than -100 (or the rows)."""

UNKNOWN_LOSS = (
    "AccumulateTrainer: the model's loss ({model}, loss_type {loss_type!r}) is not a mean over "
    "its labels other than -100, which is what count_items weights a micro-batch by (each "
    "micro-batch's mean loss times its item count), so every update would be silently wrong. "
    "Expected a loss type among {known}, or the weighting said explicitly: override "
    "AccumulateTrainer.count_items to return the number of items the micro-batch's loss is a "
    "mean over (for a CTC loss with ctc_loss_reduction='mean': the rows), or pass "
    "compute_loss_func returning such a mean."
)


def loss_refusal(model: Any, own_count: bool, own_loss: bool) -> str | None:
    """Why the Trainer's micro-batch loss cannot be weighted by ``count_items``, or None.

    Args:
        model: the unwrapped model. own_count: ``count_items`` is overridden. own_loss: a
            ``compute_loss_func`` (or an overridden ``compute_loss``) computes the loss.
    """
    loss_type = getattr(model, "loss_type", None)
    if own_count or own_loss or loss_type is None or loss_type in MEAN_OVER_LABELS:
        return None
    known = ", ".join(sorted(MEAN_OVER_LABELS))
    return UNKNOWN_LOSS.format(model=type(model).__name__, loss_type=loss_type, known=known)


def zero_loss(outputs: Any, opt: Any) -> Tensor:
    """An exact zero through the model's outputs but the loss (so that DDP and the wrapper see
    a normal pass); through the parameters if no output needs a gradient."""
    pairs = outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs)
    tensors = [v for k, v in pairs if k not in ("loss", 0) and isinstance(v, Tensor)]
    tensors = [t for t in tensors if t.requires_grad] or list(params_of(opt.param_groups))
    return sum((t.nan_to_num().sum() * 0.0 for t in tensors), tensors[0].new_zeros(()))


def smoother_shifts(model: Any) -> bool:
    """Whether the Trainer's label smoother shifts the labels of ``model`` (unwrapped): it does
    when the model's class name, or a PEFT model's base model's, is a causal-LM class name of
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``Trainer.compute_loss``, transformers 5.x) and
    only then, whatever the model's ``loss_type`` (a subclass of ``GPT2LMHeadModel`` under
    another name is not shifted)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_utils import _is_peft_model

    peft = _is_peft_model(model)  # type: ignore[no-untyped-call]
    named = model.base_model.model if peft else model
    return named._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

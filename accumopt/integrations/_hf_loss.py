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

import functools
import inspect
import re
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


NOT_LABEL_MEANS = ("Musicgen", "MusicgenMelody", "MoshiForConditionalGeneration")
"""Stock classes (name prefixes) whose loss code is not a mean over ``labels`` other than -100,
whatever their ``loss_type`` says: Musicgen's is a mean of per-codebook means that also
ignores the padding token; Moshi's labels are ``text_labels`` and ``audio_labels``."""

AUX_LOSS = (
    "AccumulateTrainer: {model} adds an auxiliary loss computed from each micro-batch as a "
    "whole ({what}): a statistic of the micro-batch, not a sum over its items, so the window's "
    "update is not the full-batch update (as with BatchNorm). Set it to 0 / False in the "
    "config for exact accumulation, or accept the difference."
)


def loss_refusal(model: Any, own_count: bool, own_loss: bool) -> str | None:
    """Why the Trainer's micro-batch loss cannot be weighted by ``count_items``, or None.

    Args:
        model: the unwrapped model. own_count: ``count_items`` is overridden. own_loss: a
            ``compute_loss_func`` (or an overridden ``compute_loss``) computes the loss.
    """
    loss_type = getattr(model, "loss_type", None)
    if own_count or own_loss:
        return None
    if type(model).__name__.startswith(NOT_LABEL_MEANS):
        loss_type = f"{loss_type}, but its own loss code"
    elif loss_type is None or loss_type in MEAN_OVER_LABELS:
        return None
    known = ", ".join(sorted(MEAN_OVER_LABELS))
    return UNKNOWN_LOSS.format(model=type(model).__name__, loss_type=loss_type, known=known)


def aux_loss_warning(model: Any) -> str | None:
    """The warning for a model whose config adds a per-micro-batch auxiliary loss (a MoE
    router's load-balancing loss, a router z-loss) to the token mean, or None."""
    config = getattr(model, "config", None)
    router = bool(getattr(config, "output_router_logits", False))  # MoE: router losses on
    terms: tuple[tuple[str, bool], ...] = (
        ("router_aux_loss_coef", router),
        ("router_z_loss_coef", router),
        ("z_loss_coefficient", True),
    )
    found = [
        f"{name}={getattr(config, name)!r}"
        for name, on in terms
        if on and getattr(config, name, None)
    ]
    if router and not hasattr(config, "router_aux_loss_coef"):
        found.append("output_router_logits=True")
    return AUX_LOSS.format(model=type(model).__name__, what=", ".join(found)) if found else None


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

    return _unpeft(model)._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _unpeft(model: Any) -> Any:
    """The model a PEFT wrapper wraps (``base_model.model``: it computes the loss), else
    ``model``."""
    from transformers.trainer_utils import _is_peft_model

    return model.base_model.model if _is_peft_model(model) else model  # type: ignore[no-untyped-call]


AMBIGUOUS_SHIFT = (
    "AccumulateTrainer: {model} computes its loss in code of its own (not through transformers' "
    "loss functions), and its name says causal LM, so accumopt cannot tell whether the loss "
    "predicts labels[..., 1:] (ClvpForCausalLM shifts; XLNetLMHeadModel, XLMWithLMHeadModel and "
    "TrOCRForCausalLM do not), which decides how many labels each micro-batch is weighted by. "
    "Nothing was trained. Expected AccumulateTrainer(..., shift_labels=True) if the loss "
    "shifts the labels, shift_labels=False if it does not, or count_items overridden to return "
    "what the loss is a mean over."
)


def loss_shifts(model: Any, trainer_guess: bool, own_loss: bool) -> bool:
    """Whether the micro-batch loss of ``model`` (unwrapped) predicts ``labels[..., 1:]``.

    - An encoder-decoder: no (as ``Trainer._loss_shifts_labels``).
    - A loss computed outside the model (``own_loss``: ``compute_loss_func``, an overridden
      ``compute_loss``) or by a ``loss_function`` replaced on it: the Trainer's guess
      (``trainer_guess``: a ``ForCausalLMLoss`` loss type) or a ``*ForCausalLM`` /
      ``*LMHeadModel`` class name (README: say ``shift_labels`` otherwise).
    - A ``forward`` that calls ``self.loss_function`` (itself or through ``super().forward``):
      yes where its ``loss_type`` maps to ``ForCausalLMLoss``, or is None (transformers then
      uses ``ForCausalLMLoss``: ``GPT2LMHeadModel``, ``ReformerModelWithLMHead``).
    - A loss in code of the model's own: no, unless its name or the Trainer's guess says
      causal LM, where the code decides and :data:`AMBIGUOUS_SHIFT` is raised.

    Raises:
        ValueError: :data:`AMBIGUOUS_SHIFT`.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    model = _unpeft(model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    if own_loss or "_loss_function" in vars(model):  # model.loss_function = f: the user's
        return trainer_guess or causal
    if _through_loss_function(model.__class__):
        loss = LOSS_MAPPING.get(getattr(model, "loss_type", None) or "", ForCausalLMLoss)
        return loss is ForCausalLMLoss
    if causal or trainer_guess:
        raise ValueError(AMBIGUOUS_SHIFT.format(model=type(model).__name__))
    return False


@functools.cache
def _through_loss_function(cls: Any) -> bool:
    """Whether ``cls.forward`` computes its loss with ``self.loss_function`` (read from its
    source, following ``super().forward`` through overrides without loss code of their own,
    :data:`_OWN_LOSS`); False where the source cannot be read."""
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
            return False  # an override that computes a loss of its own is its own code
    return False


_OWN_LOSS = re.compile(r"\bloss\w*\s*=|cross_entropy|CrossEntropyLoss|nll_loss|NLLLoss")
"""Loss code in a ``forward`` that calls ``super().forward``: an assignment to a ``loss*``
name or a cross-entropy / NLL loss."""

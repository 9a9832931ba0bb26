"""BatchNorm under micro-batching: a one-time warning and a remedy for the running statistics.

Gradient accumulation is exact for models whose forward pass treats samples independently.
BatchNorm does not: in training mode it normalises each micro-batch with that micro-batch's
own mean and variance, so a small micro-batch changes the function being trained (noisier
statistics), and its running averages are updated once per micro-batch instead of once per
virtual batch. Remedies, from cheapest: keep micro-batches large enough (>= 32 rows is the
common rule of thumb); use GroupNorm/LayerNorm, which do not depend on the batch; use
``torch.nn.SyncBatchNorm`` across devices; and :func:`scale_batchnorm_momentum`, which makes
the running statistics decay per window as they would per batch without accumulation.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

from accumopt._checks import positive_int

SMALL_MICRO_BATCH = 16
"""Rows below which a training-mode BatchNorm's batch statistics are considered unreliable."""

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``model`` that are in training mode and track statistics."""
    return [
        m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


def warn_small_batchnorm(model: nn.Module | None, micro_batch_size: int) -> None:
    """Warn once per model when training-mode BatchNorm meets micro-batches below
    :data:`SMALL_MICRO_BATCH` rows (a ``UserWarning`` naming the layers and the remedies);
    ``model=None`` (no model known) does nothing."""
    if model is None or micro_batch_size >= SMALL_MICRO_BATCH or model in _warned:
        return
    layers = batchnorm_layers(model)
    if not layers:
        return
    _warned.add(model)
    names = [name for name, m in model.named_modules() if m in layers][:5]
    warnings.warn(
        f"accumopt: micro-batches of {micro_batch_size} rows pass through {len(layers)} "
        f"BatchNorm layer(s) in training mode ({', '.join(names)}...); each normalises with its "
        "own micro-batch's statistics, so the update is no longer the full-batch update. "
        "Use larger micro-batches, GroupNorm/LayerNorm, or SyncBatchNorm; "
        "accumopt.batchnorm.scale_batchnorm_momentum keeps the running averages per window.",
        UserWarning,
        stacklevel=3,
    )


def scale_batchnorm_momentum(model: nn.Module, micro_steps: int) -> None:
    """Rescale every BatchNorm's momentum so k micro-batch updates decay like one batch update.

    A running average updated with momentum ``m`` once per micro-batch, ``k`` times per window,
    forgets old statistics as ``(1 - m) ** k`` per window. Setting ``m' = 1 - (1 - m) ** (1/k)``
    restores the decay of one update per (virtual) batch, so the running statistics follow the
    window cadence instead of the micro-batch cadence. Layers with ``momentum=None``
    (cumulative averages) are left alone: they already weight every micro-batch equally.

    Args:
        model: modified in place.
        micro_steps: micro-batches per window (``every``), an int >= 1.

    Raises:
        ValueError: ``micro_steps`` is not a positive int.
    """
    if not positive_int(micro_steps):
        raise ValueError(
            f"scale_batchnorm_momentum: micro_steps={micro_steps!r}; expected the number of "
            "micro-batches per window, an int >= 1."
        )
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is not None:
            m.momentum = 1.0 - (1.0 - m.momentum) ** (1.0 / micro_steps)

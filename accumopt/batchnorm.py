"""BatchNorm under micro-batching (each micro-batch normalised with its own statistics): a
one-time warning, and a remedy for the running statistics (docs/guide/one-big-batch.md)."""

from __future__ import annotations

import warnings
import weakref

from torch import nn

from accumopt._checks import positive_int

SMALL_MICRO_BATCH = 16
"""Rows below which a training-mode BatchNorm's batch statistics are considered unreliable."""

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def warn_small_batchnorm(model: nn.Module | None, micro_batch_size: int) -> None:
    """Warn once per model (a ``UserWarning`` naming the layers and the remedies) when
    micro-batches of fewer than :data:`SMALL_MICRO_BATCH` rows meet its BatchNorm layers in
    training mode; ``model=None`` does nothing."""
    if model is None or micro_batch_size >= SMALL_MICRO_BATCH or model in _warned:
        return
    batchnorm = nn.modules.batchnorm._BatchNorm
    names = [n for n, m in model.named_modules() if isinstance(m, batchnorm) and m.training]
    if not names:
        return
    _warned.add(model)
    message = (
        f"accumopt: micro-batches of {micro_batch_size} rows pass through {len(names)} "
        f"BatchNorm layer(s) in training mode ({', '.join(names[:5])}...), each normalising with "
        "its micro-batch's statistics, not the full batch's. Use larger micro-batches, "
        "GroupNorm/LayerNorm or SyncBatchNorm; accumopt.batchnorm.scale_batchnorm_momentum "
        "keeps the running averages per window."
    )
    warnings.warn(message, UserWarning, stacklevel=3)


def scale_batchnorm_momentum(model: nn.Module, micro_steps: int) -> None:
    """Rescale every BatchNorm's momentum in ``model`` (in place) so that ``micro_steps``
    updates per window (an int >= 1, else ValueError) decay like one: ``m`` becomes
    ``1 - (1 - m) ** (1 / micro_steps)``. Layers with ``momentum=None`` are left alone."""
    if not positive_int(micro_steps):
        raise ValueError(
            f"scale_batchnorm_momentum: micro_steps={micro_steps!r}; expected the number of "
            "micro-batches per window, an int >= 1."
        )
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is not None:
            m.momentum = 1.0 - (1.0 - m.momentum) ** (1.0 / micro_steps)

"""The gradients FSDP2 keeps back inside a window, and how a dropped window lets go of them.

With gradient sync off (``FSDPModule.set_requires_gradient_sync(False)``, what accumopt sets
inside a window), FSDP2 does not reduce-scatter a micro-step's gradient into the sharded
``.grad``: it keeps the unsharded sum itself (each ``FSDPParam``'s unsharded parameter's
``.grad``, or ``unsharded_accumulated_grad`` when the reduce dtype differs) and adds it into
the next synced pass. ``opt.discard()`` must drop those too, or the dropped micro-steps would
be reduced into the next window (silently). torch has no public call for it (torch 2.11-2.13:
``FSDPModule._get_fsdp_state()``, whose ``_fsdp_param_groups`` (or ``_fsdp_param_group``) hold
the ``fsdp_params``); ``tests/test_torch_private_api.py`` pins it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

FLUSH_UNSUPPORTED = (
    "Accumulate.flush: the open window of {steps} micro-step(s) was accumulated by FSDP2 "
    "without a gradient sync, and FSDP2 reduce-scatters such gradients only inside a synced "
    "backward pass, so the partial window cannot be applied on its own. Nothing changed; "
    "expected windows that end with the data (every dividing the micro-batches per epoch), or "
    "reduce_every_micro_step=True (each micro-step reduce-scattered: flush() then works), or "
    "opt.discard() to drop the partial window."
)


CHANGED = (
    "Accumulate.discard: this torch's FSDP2 has no {what}, where accumopt drops the gradients "
    "FSDP2 holds back inside a window (tested on torch 2.11-2.13); the window could not be "
    "dropped safely. Expected a supported torch version."
)


def _param_groups(module: nn.Module) -> Iterator[Any]:
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            if not hasattr(state, "_fsdp_param_group"):
                raise RuntimeError(CHANGED.format(what="FSDPState._fsdp_param_group(s)"))
            single = state._fsdp_param_group
            groups = [] if single is None else [single]
        yield from groups


def drop_pending(module: nn.Module) -> None:
    """Drop every unsharded gradient FSDP2 holds for a later reduce-scatter in ``module``'s
    tree (the micro-steps of a window that is being discarded)."""
    for group in _param_groups(module):
        for fsdp_param in group.fsdp_params:
            if not hasattr(fsdp_param, "unsharded_accumulated_grad"):
                raise RuntimeError(CHANGED.format(what="FSDPParam.unsharded_accumulated_grad"))
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

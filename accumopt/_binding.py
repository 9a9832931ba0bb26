"""What the wrapper learns from outside after it is built: the model, and a GradScaler.

Frameworks build the optimizer before they wrap the model (Accelerate's ``prepare``, the HF
Trainer, Lightning's strategies put DDP/FSDP2 around it later), and wrappers such as timm's
``NativeScaler`` call ``scaler.step(opt)`` with a ``GradScaler`` the wrapper was never given.
Both are learned here between windows, with the checks the constructor runs, so the result is
the same wrapper as one built with ``model=`` / ``scaler=`` from the start. A scaler is adopted
only while nothing of the window was summed without its loss scale (see :func:`adopt_scaler`):
where the window buffer already holds the first micro-step (``buffer=True``, bf16 parameters,
a per-micro-batch non-finite policy), ``scaler.step`` is refused; build with ``scaler=`` there.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from accumopt import _checks, _noise_attach
from accumopt._backward_counter import BackwardCounter
from accumopt._grads import params_of
from accumopt.distributed import GradSync, LocalSync, is_distributed, sync_for

if TYPE_CHECKING:
    from accumopt.accumulate import AccumulatingOptimizer


def bind(
    opt: AccumulatingOptimizer, model: torch.nn.Module | None, count_at: str = "outputs"
) -> None:
    """Count ``opt``'s backward passes for ``model`` and synchronise through it (DDP/FSDP2).

    Every check runs before anything changes; the previous model's sync setting comes back
    and its counting hooks are removed. Used by the constructor and ``set_model``.

    Args:
        count_at: ``"outputs"`` (at the tensors ``model`` returns) or ``"parameters"`` (at
            the parameters, as without a model: for backward passes that run before the
            model's forward returns, e.g. Lightning's ``manual_backward`` inside DDP).

    Raises:
        TypeError / ValueError: as ``Accumulate(..., model=model)`` would; a bad
            ``count_at``, or ``"parameters"`` with an FSDP2 model (its sharded parameters
            are not in the autograd graph).
    """
    model = _checks.check_model(model, opt.optimizer)
    distributed = is_distributed(model)
    if count_at not in ("outputs", "parameters"):
        raise ValueError(
            f"Accumulate.set_model: count_at={count_at!r}; expected 'outputs' (at the tensors "
            "the model returns) or 'parameters' (at the parameters' gradients)."
        )
    fsdp = distributed and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if count_at == "parameters" and fsdp:
        raise ValueError(
            "Accumulate.set_model: count_at='parameters' with an FSDP2 model, whose sharded "
            "parameters are not in the autograd graph; expected count_at='outputs'."
        )
    _checks.check_policies(opt.nonfinite, opt.scaler, opt.buffer, distributed)
    params = params_of(opt.param_groups)
    sync: GradSync | LocalSync = sync_for(model, params[0].device, opt.reduce_every_micro_step)
    if isinstance(sync, GradSync):  # refused: the new sync's hooks go with it (weakref.finalize)
        sync.check_fsdp(opt._window.every, opt.scaler, opt._buffer.buffer_all)
    counted = model if count_at == "outputs" else None
    counter = BackwardCounter(opt._on_backward_end, counted, confirm_accumulation=not sync.fsdp)
    counter.watch_groups(opt.param_groups)
    old_sync, old_counter = opt.__dict__.get("_sync"), opt.__dict__.get("_counter")
    if old_counter is not None:
        old_counter.remove()
    if old_sync is not None:
        old_sync.release(opt._window)
    opt.model, opt._sync, opt._counter = model, sync, counter
    opt._plan_sync()
    if opt.__dict__.get("noise_scale") is not None:  # its hooks live on the sync object
        opt.noise_scale = _noise_attach.attach(opt, opt.noise_scale)


def release(opt: AccumulatingOptimizer) -> None:
    """Stop counting ``opt``'s backward passes: every counting hook is removed, the window
    and the inner optimizer stay as they are. For a framework's run that ended (Lightning's
    ``AccumulateCallback`` at the end of a fit, or its exception): a later run on the same
    model with another wrapper is then not counted into this one. :func:`reattach` undoes it."""
    opt._counter.remove()


def reattach(opt: AccumulatingOptimizer) -> None:
    """Count ``opt``'s backward passes again, where they were counted before :func:`release`
    (at the model's outputs or at the parameters); nothing happens if it was not released."""
    old = opt._counter
    if old.retired:
        bind(opt, opt.model, "parameters" if old._module is None else "outputs")
        if old.paused:  # a pass that died part-way before the release: still refused
            opt._counter.pause(old.paused_reason)


def keep_out_of_grad(acc: Any) -> None:
    """Move an open window of the wrapper ``acc`` out of ``.grad`` into its window buffer, for
    the rest of a Lightning fit (``AccumulateCallback``; also its load_state_dict post hook):
    Lightning zeroes the module's gradients after ``on_fit_start`` and after it restored a
    checkpoint, which would wipe a window held there. Raises RuntimeError where it cannot."""
    if not acc.micro_step:
        return
    try:
        acc.enable_rollback()
    except RuntimeError as err:
        raise RuntimeError(
            f"AccumulateCallback: the fit starts inside an open window of {acc.micro_step} "
            "micro-step(s) (a checkpoint saved mid-window, or a wrapper returned again after a "
            "fit that raised), which must leave .grad before Lightning zeroes the gradients at "
            f"the fit's start, and could not: {err}"
        ) from err


def calling_scaler() -> torch.amp.GradScaler | None:
    """The ``GradScaler`` whose ``step(opt)`` is running, found on the call stack (its
    ``step`` calls the optimizer's ``step`` directly; a few frames allow for wrappers)."""
    frame = sys._getframe(1)
    for _ in range(8):
        # torch's frames only: reading f_locals snapshots a frame's locals into it (before
        # Python 3.13), which would keep a caller's objects alive
        if frame.f_globals.get("__name__", "").startswith("torch."):
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.amp.GradScaler):
                return candidate
        if frame.f_back is None:
            break
        frame = frame.f_back
    return None


def adopt_scaler(opt: AccumulatingOptimizer) -> None:
    """``scaler.step(opt)`` on a wrapper built without ``scaler=``: adopt that scaler if no
    micro-step of the open window was folded yet (its first micro-step is still in ``.grad``,
    scaled by the scale the scaler hands in now); else leave it to the refusal."""
    scaler = calling_scaler()
    window, buffer = opt._window, opt._buffer
    if scaler is None or window.micro_step > 1 or buffer.sums or buffer.unfolded:
        return
    _checks.check_policies(opt.nonfinite, scaler, opt.buffer, isinstance(opt._sync, GradSync))
    if isinstance(opt._sync, GradSync):
        opt._sync.check_fsdp(window.every, scaler, buffer.buffer_all)
    opt.scaler = buffer.scaler = _checks.check_scaler(scaler)
    if window.micro_step == 1 and not window.closed:
        buffer.unfolded = 1  # the first micro-step, scaled, waits in .grad for this step


@contextmanager
def scaler_call(opt: AccumulatingOptimizer) -> Iterator[None]:
    """Around the wrapper's ``step()`` at a boundary: ``GradScaler.step`` sets ``grad_scale``
    and ``found_inf`` on the wrapper for the duration of ``step()`` and deletes them only when
    it returns; when it raises they are deleted here, so that a plain ``opt.step()`` retried
    after it does not take the AMP path with that call's values (the next window's first
    micro-step was unscaled twice, silently)."""
    try:
        yield
    except BaseException:
        opt.__dict__.pop("found_inf", None)  # first: without it, step() takes no AMP path
        opt.__dict__.pop("grad_scale", None)
        raise

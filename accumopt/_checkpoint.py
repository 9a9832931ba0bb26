"""The wrapper's checkpoint format, in one place: ``state_dict``, ``load_state_dict``, pickling.

A wrapper's state dict is the inner optimizer's state dict plus one ``"accumopt"`` entry::

    {"format": 3, "every": 4, "every_items": None, "reduction": "mean", "updates": 12,
     "window": None | {"micro_step", "items", "weighted", "closed", "stepped", "size",
                       "grads": {param index: .grad}, "buffer": {param index: sum},
                       "buffer_all", "found_inf", "unfolded", "rank"},
     "schedule": {"scheduled", "updates", "items_seen", "size", "schedule_state"},
     "noise_scale": None | NoiseScale.state_dict()}

Parameter indices count over the param groups in order, as the inner state dict's ``"state"``
does. ``"window"`` is None at an accumulation boundary. Formats read:

- 1: the same entry with ``"version": 1`` in place of ``"format": 2`` (accumopt 0.1.0).
- 2: the entry without ``"schedule"``, ``"noise_scale"`` and the window's ``"size"``.
- 3: the entry above. With a window schedule, ``"every"``/``"every_items"`` are the open
  window's size; the schedule itself is not stored (the loading wrapper is built with it), only
  where it stands: updates, items seen, the open window's size and the schedule's own
  ``state_dict()`` (``schedules.AdaptiveBatch``), and the noise-scale averages. Under DDP/FSDP2
  a weighted window counted in micro-steps saves this rank's own ``"items"`` (they are summed
  over the ranks at the boundary); formats 1-2 saved them summed already, and such a window is
  loaded with the sum on rank 0 and 0 on the others. A window's ``"rank"`` is ``[rank, ranks]``
  of the process that saved it (``[0, 1]`` without a DDP/FSDP2 model; absent in entries written
  before 2026-12-02): its gradients and items are that rank's own, so it loads only there.

A change of the entry's meaning gets a new format number, and this module keeps reading the
older ones.

Under ``torch.distributed.checkpoint`` (DCP), whose ``get_optimizer_state_dict`` keeps only
``"state"`` and ``"param_groups"``, the entry travels packed in param group 0
(``accumopt.integrations.dcp``). An FSDP2 window that FSDP2 still holds unreduced is refused at
save time, in either form.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from accumopt import _grads, _guards
from accumopt._entry_checks import KEY, check_entry, format_of
from accumopt.integrations import dcp
from accumopt.integrations.dcp import dcp_init_step as dcp_init_step  # for the wrapper's step()

if TYPE_CHECKING:
    from accumopt.accumulate import AccumulatingOptimizer

FORMAT = 3


def state_dict(opt: AccumulatingOptimizer) -> dict[str, Any]:
    """The inner optimizer's state dict plus one ``"accumopt"`` entry (the format above).

    Raises:
        RuntimeError: as :func:`check_settled` (a partial gradient, a step() to retry, a
            dropped micro-step the GradScaler has not seen); or an FSDP2 model's open window
            is still inside FSDP2 (unreduced, see :func:`_check_savable`).
        ValueError: called by DCP with ``flatten_optimizer_state_dict=True`` (DCP would drop
            the entry at load).

    Mid-window the entry holds the window's position and gradients, so a run saved mid-window
    resumes bit for bit. Tensors are referenced, not copied (as in ``torch.optim``):
    ``torch.save`` or ``copy.deepcopy`` the dict before training on. A bare ``torch.optim``
    optimizer loads it too (the extra entry is ignored). Called by DCP's
    ``get_optimizer_state_dict``, the entry is packed into the first param group (see above;
    mid-window on several ranks, a collective of all ranks, as DCP's own calls are).
    """
    check_settled(opt, "state_dict")
    _check_savable(opt)
    by_dcp = dcp.caller_checked()  # refuses DCP's flattened form
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    state = opt.optimizer.state_dict()
    params = _grads.params_of(opt.param_groups)
    window = None
    if opt._window.micro_step:
        grads = {i: p.grad for i, p in enumerate(params) if p.grad is not None}
        window = {**opt._window.position(), "grads": grads, **opt._buffer.contents(params)}
        window["rank"] = [opt._sync.rank, opt._sync.world_size]
    every, every_items, reduction = opt._window.settings()
    entry = {
        "format": FORMAT,
        "every": every,
        "every_items": every_items,
        "reduction": reduction,
        "updates": opt.updates,
        "window": window,
        "schedule": {"scheduled": opt._window.schedule is not None, **opt._window.progress()},
        "noise_scale": None if opt.noise_scale is None else opt.noise_scale.state_dict(),
    }
    if by_dcp:
        state["param_groups"][0][KEY] = dcp.pack(opt, entry)
    else:
        state[KEY] = entry
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, state)
        if result is not None:
            state = result
    return state


def load_state_dict(opt: AccumulatingOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a state dict from :func:`state_dict`, or a bare inner-optimizer state dict (which
    starts a fresh window). Everything is checked before anything is loaded.

    Raises:
        TypeError: ``state_dict`` is not a dict.
        ValueError: its ``"accumopt"`` entry has a format this version cannot read, or holds
            an open window saved with other window settings, for other parameter shapes, on
            another number of ranks or shards; or a DCP entry is damaged. Nothing is changed.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"Accumulate.load_state_dict: got {type(state_dict).__qualname__}; expected the "
            "dict returned by state_dict() (or by a bare torch.optim optimizer)."
        )
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    state_dict = dcp.unpack(opt, state_dict, KEY)
    extra = state_dict.get(KEY)
    params = _grads.params_of(opt.param_groups)
    window = check_entry(opt, extra, params)
    inner_state = {k: v for k, v in state_dict.items() if k != KEY}
    saved_progress = (extra or {}).get("schedule")
    undo = _load_schedule_state(opt, saved_progress or {})
    try:
        opt.optimizer.load_state_dict(inner_state)
    except BaseException:
        undo()
        raise
    opt.updates = int(extra["updates"]) if extra else 0
    # torch's load_state_dict installs new group and state containers on the inner
    # optimizer: share the new ones (schedulers built later must reach the inner).
    opt.param_groups = opt.optimizer.param_groups
    opt.state = opt.optimizer.state
    progress = saved_progress or {"updates": opt.updates, "items_seen": 0.0}
    opt._window.restore_progress({**progress, "schedule_state": None})  # loaded above
    if opt.noise_scale is not None and extra and extra.get("noise_scale") is not None:
        opt.noise_scale.load_state_dict(extra["noise_scale"])
    # a restored window starts from its own gradients only: none left from a live window, the
    # last update before zero_grad(), or a backward pass that failed part-way
    try:
        opt._restart(clear_grads=True)  # asks a schedule for a size (it may raise)
    except BaseException:
        if window is not None:  # not restored: refusing until discard() or another load
            opt._counter.pause("interrupted")
        raise
    if window is not None:
        opt._window.restore(window)
        with torch.no_grad():
            for i, g in window["grads"].items():
                params[i].grad = g.to(device=params[i].device, dtype=params[i].dtype, copy=True)
        opt._buffer.restore(window, params)
        opt._sync.restored(opt._window, items_global=format_of(extra or {}) < 3)
        opt._plan_sync()
    # The loaded gradients are noted afresh, so that a wipe before the window's close (a
    # framework's zero_grad) is refused; not its learning rates: a scheduler is often loaded
    # after the optimizer.
    guard = opt._guard
    guard.forget()
    if window is not None and opt._window.micro_step and not opt._window.closed:
        unmarked = guard.lrs, guard.schedulers
        _guards.note(opt)
        guard.lrs, guard.schedulers = unmarked
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _load_schedule_state(
    opt: AccumulatingOptimizer, progress: dict[str, Any]
) -> Callable[[], None]:
    """Load the window schedule's own state (user code, so before anything else loads), once;
    a load that raises is undone from a copy of the state before and refused (ValueError).
    Returns the undo, for a failure of what loads after it."""
    state, schedule = progress.get("schedule_state"), opt._window.schedule
    load, save = getattr(schedule, "load_state_dict", None), getattr(schedule, "state_dict", None)
    if state is None or not callable(load):
        return lambda: None
    before = copy.deepcopy(save()) if callable(save) else None

    def undo() -> None:
        if before is not None:
            with contextlib.suppress(Exception):  # the error raised is the load's
                load(copy.deepcopy(before))

    try:
        load(state)
    except Exception as err:
        undo()
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint's schedule state {str(state)[:200]} "
            f"does not load into {schedule!r} ({type(err).__name__}: {err}); expected the "
            "state_dict() of the same schedule. The checkpoint was changed or damaged. Nothing "
            "was changed (the schedule's state was restored where it has a state_dict())."
        ) from None
    return undo


def _check_savable(opt: AccumulatingOptimizer) -> None:
    """Refuse to save an FSDP2 window that FSDP2 still holds: micro-steps run without gradient
    sync add up in FSDP2's unsharded gradients, not in ``.grad``, until the closing micro-step
    reduce-scatters them; no state dict reaches them (RuntimeError, nothing changed)."""
    window, ranks = opt._window, opt._ranks
    if ranks is None or not ranks.fsdp or not window.micro_step or window.closed:
        return
    if ranks.reduce_every_micro_step:  # every micro-step was reduce-scattered into .grad
        return
    raise RuntimeError(
        f"Accumulate.state_dict: the open window ({window.micro_step} of {window.every} "
        "micro-steps) of this FSDP2 model is held by FSDP2 itself, in unsharded gradients not "
        "yet reduce-scattered into .grad, which no state dict reaches; expected a save at an "
        "accumulation boundary (opt.micro_step == 0, e.g. when opt.did_update), once the "
        "window is complete (opt.will_update, before step()), or a wrapper built with "
        "reduce_every_micro_step=True (its sharded .grad holds the window). Nothing was saved; "
        "the window is intact."
    )


_SETTINGS = (
    "max_grad_norm",
    "scaler",
    "buffer",
    "nonfinite",
    "model",
    "reduce_every_micro_step",
    "noise_scale",
)


def check_settled(opt: AccumulatingOptimizer, api: str) -> None:
    """Refuse to save (``api``: ``state_dict``, ``copy``) a wrapper whose state is not what a
    checkpoint holds: a backward pass failed part-way (its partial gradient is in ``.grad``);
    a ``step()`` raised after the window's update began (whether it was applied, whether the
    gradient was unscaled and clipped: the retry's bookkeeping); a micro-step dropped for an
    inf/NaN that waits for ``scaler.step(opt)`` (refused by ``_check_not_paused``). A resumed
    run would train on each of them wrongly. RuntimeError, nothing changed."""
    opt._check_not_paused(api)
    window, buffer = opt._window, opt._buffer
    if window.closed and (window.inner_base is not None or buffer.unscaled or buffer.final):
        raise RuntimeError(
            f"Accumulate.{api}: the window's update began in a step() that raised (its "
            f"update {'was' if window.done else 'was not'} applied); which parts of it are done "
            "is not part of a checkpoint, and a run resumed from one would apply or unscale "
            "the window a second time. Expected step() again (scaler.step(opt) under AMP, or "
            "flush() again after a flush()) to finish it first, then save. Nothing was saved."
        )


def getstate(opt: AccumulatingOptimizer) -> dict[str, Any]:
    """What ``copy.deepcopy`` and pickling keep of a wrapper. A whitelist: an LR scheduler
    patches ``step`` on the instance with a closure over a weakref, which must neither be
    pickled nor shared by a deep copy. Refused as :func:`check_settled` (RuntimeError)."""
    check_settled(opt, "copy (deepcopy or pickle)")
    params = _grads.params_of(opt.param_groups)
    every, every_items = opt._window.spec()  # the schedule, if any
    settings = {"every": every, "every_items": every_items, "reduction": opt.reduction}
    settings.update({name: getattr(opt, name) for name in _SETTINGS})
    return {
        "optimizer": opt.optimizer,
        "settings": settings,
        "skipped_micro_steps": opt.skipped_micro_steps,
        "updates": opt.updates,
        "did_update": opt.did_update,
        "window": opt._window.position(),
        "progress": opt._window.progress(),
        "grads": [p.grad for p in params] if opt._window.micro_step else None,
        "buffer": opt._buffer,
    }


def setstate(opt: AccumulatingOptimizer, state: dict[str, Any]) -> None:
    """Rebuild a wrapper from :func:`getstate` (its own hooks, the copied window)."""
    settings = dict(state["settings"])
    every = settings.pop("every")
    type(opt).__init__(opt, state["optimizer"], every, **settings)
    opt.skipped_micro_steps = state["skipped_micro_steps"]
    opt.updates = state["updates"]
    opt.did_update = state["did_update"]
    opt._window.restore_progress(state["progress"])
    opt._window.restore(state["window"])
    opt._buffer = state["buffer"]
    opt._buffer.forget_params()
    if state["grads"] is not None:
        for p, g in zip(_grads.params_of(opt.param_groups), state["grads"]):
            p.grad = g
    if opt._window.micro_step and not opt._window.closed:  # a wipe of the copy is refused too
        _guards.note_grads(opt)

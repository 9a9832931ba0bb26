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

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from accumopt import _grads, _guards
from accumopt._checks import positive_int
from accumopt.integrations import dcp
from accumopt.integrations.dcp import dcp_init_step as dcp_init_step  # for the wrapper's step()

if TYPE_CHECKING:
    from accumopt.accumulate import AccumulatingOptimizer

KEY = "accumopt"
FORMAT = 3
_READABLE = (1, 2, 3)


def state_dict(opt: AccumulatingOptimizer) -> dict[str, Any]:
    """The inner optimizer's state dict plus one ``"accumopt"`` entry (the format above).

    Raises:
        RuntimeError: a backward pass failed part-way and its partial gradient is still in
            ``.grad`` (see ``discard``); a resumed run would train on it. Or an FSDP2 model's
            open window is still inside FSDP2 (unreduced, see :func:`_check_savable`).
        ValueError: called by DCP with ``flatten_optimizer_state_dict=True`` (DCP would drop
            the entry at load).

    Mid-window the entry holds the window's position and gradients, so a run saved mid-window
    resumes bit for bit. Tensors are referenced, not copied (as in ``torch.optim``):
    ``torch.save`` or ``copy.deepcopy`` the dict before training on. A bare ``torch.optim``
    optimizer loads it too (the extra entry is ignored). Called by DCP's
    ``get_optimizer_state_dict``, the entry is packed into the first param group (see above;
    mid-window on several ranks, a collective of all ranks, as DCP's own calls are).
    """
    opt._check_not_paused("state_dict")  # a partial gradient must not be saved as the window
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
    window = _check_entry(opt, extra, params)
    inner_state = {k: v for k, v in state_dict.items() if k != KEY}
    opt.optimizer.load_state_dict(inner_state)
    opt.updates = int(extra["updates"]) if extra else 0
    # torch's load_state_dict installs new group and state containers on the inner
    # optimizer: share the new ones (schedulers built later must reach the inner).
    opt.param_groups = opt.optimizer.param_groups
    opt.state = opt.optimizer.state
    progress = (extra or {}).get("schedule") or {"updates": opt.updates, "items_seen": 0.0}
    opt._window.restore_progress(progress)
    if opt.noise_scale is not None and extra and extra.get("noise_scale") is not None:
        opt.noise_scale.load_state_dict(extra["noise_scale"])
    # a restored window starts from its own gradients only (none left from a live window or
    # from the last update before zero_grad())
    opt._restart(clear_grads=bool(opt._window.micro_step) or window is not None)
    if window is not None:
        opt._window.restore(window)
        with torch.no_grad():
            for i, g in window["grads"].items():
                params[i].grad = g.to(device=params[i].device, dtype=params[i].dtype, copy=True)
        opt._buffer.restore(window, params)
        opt._sync.restored(opt._window, items_global=_format(extra or {}) < 3)
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


def _format(extra: dict[str, Any]) -> Any:
    """The entry's format number (format 1 called it ``"version"``)."""
    return extra.get("format", extra.get("version"))


def _check_entry(
    opt: AccumulatingOptimizer, extra: Any, params: list[Tensor]
) -> dict[str, Any] | None:
    """The checkpoint's open window, if any, after checking that it fits this wrapper."""
    if extra is None:
        return None
    fmt = _format(extra)
    if fmt not in _READABLE:
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint's accumopt entry has format {fmt!r}; "
            f"expected one of {_READABLE} (this accumopt reads those). Load it with the "
            "accumopt version that wrote it, or save at an accumulation boundary and load the "
            "inner optimizer's state alone."
        )
    window: dict[str, Any] | None = extra.get("window")
    if window is None:
        return None
    _check_position(window)
    problem = _rank_problem(opt, window.get("rank"))
    if problem is not None:
        raise ValueError(problem)
    saved: tuple[object, ...] = (extra["every"], extra["every_items"], extra["reduction"])
    ours: tuple[object, ...] = opt._window.settings()
    scheduled = bool((extra.get("schedule") or {}).get("scheduled"))
    if scheduled or opt._window.schedule is not None:  # the open window's size is restored
        saved = ("schedule" if scheduled else saved[0], saved[1] is None, saved[2])
        ours = ("schedule" if opt._window.schedule else ours[0], ours[1] is None, ours[2])
    if saved != ours:
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint holds an open window saved with "
            f"(every, every_items, reduction)={saved!r}, this wrapper has {ours!r}; "
            "expected the same settings to resume mid-window. Rebuild the wrapper with "
            "the saved settings, or save at an accumulation boundary."
        )
    for kind in ("grads", "buffer"):
        for i, tensor in window[kind].items():
            if i >= len(params) or tuple(tensor.shape) != tuple(params[i].shape):
                have = f"shape {tuple(params[i].shape)}" if i < len(params) else "no such one"
                raise ValueError(
                    f"Accumulate.load_state_dict: the checkpoint's window holds a gradient of "
                    f"shape {tuple(tensor.shape)} for parameter {i}, this optimizer has {have} "
                    f"({len(params)} parameters); expected the same model and parameter "
                    "groups as when it was saved. Nothing was changed."
                )
    return window


def _check_position(window: dict[str, Any]) -> None:
    """Refuse a window position no wrapper writes (a damaged or edited checkpoint)."""
    items = window.get("items")
    problems = {
        "micro_step": not positive_int(window.get("micro_step")),
        "items": isinstance(items, bool)
        or not isinstance(items, numbers.Real)
        or not math.isfinite(items)
        or items < 0,
        "weighted": window.get("weighted") not in (None, True, False),
        "closed": not isinstance(window.get("closed"), bool),
        "stepped": not isinstance(window.get("stepped"), bool),
        "unfolded": not (window.get("unfolded", 0) == 0 or positive_int(window.get("unfolded"))),
        "rank": window.get("rank") is not None and not _is_place(window.get("rank")),
    }
    bad = [f"{key}={window.get(key)!r}" for key, wrong in problems.items() if wrong]
    if bad:
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint's open window has {', '.join(bad)}; "
            "expected micro_step an int >= 1, items a finite number >= 0, weighted None or a "
            "bool, closed and stepped bools, unfolded an int >= 0, rank [rank, ranks] (ints, "
            "0 <= rank < ranks), as state_dict() writes them. "
            "The checkpoint was changed or damaged: load an intact one. Nothing was changed."
        )


def _rank_problem(opt: AccumulatingOptimizer, saved: Any) -> str | None:
    """Why an open window saved by ``saved`` (``[rank, ranks]``, or None: not recorded) must
    not load here: another rank's, or another number of ranks' (its partial gradient and items
    are that rank's own); None where it may."""
    here = [opt._sync.rank, opt._sync.world_size]
    if saved is None or list(saved) == here:
        return None
    return (
        f"Accumulate.load_state_dict: the checkpoint's open window was saved by rank "
        f"{saved[0]} of {saved[1]}, and is loaded on rank {here[0]} of {here[1]} (ranks of the "
        "wrapper's DDP/FSDP2 model; 0 of 1 without one); its partial gradient and items are "
        f"the saving rank's own, and training on them here would give a wrong update. {_OWN}"
    )


_OWN = (
    "Expected each rank to load the state dict it saved itself, on as many ranks, with the "
    "model given to the wrapper (model= or set_model) before loading. A framework that saves "
    "rank 0's optimizer state alone (Lightning's DDP) can resume from a checkpoint saved at an "
    "accumulation boundary only (opt.micro_step == 0, e.g. right after an update). Nothing was "
    "changed."
)


def owners_agree(all_ranks: Callable[[bool], bool]) -> Callable[[Any, Any], None]:
    """A ``load_state_dict`` pre-hook for a framework that loads one rank's optimizer state on
    every rank (Lightning's DDP saves rank 0's alone): the ranks agree (``all_ranks(ok)``, a
    collective: True where it is True on every rank) whether each loads an open window it
    saved itself, and every rank raises ValueError if one does not; no rank goes on to wait
    in a collective for one that raised."""

    def hook(opt: Any, state: Any) -> None:
        entry = state.get(KEY) if isinstance(state, dict) else None
        window = entry.get("window") if isinstance(entry, dict) else None
        saved = window.get("rank") if isinstance(window, dict) else None
        problem = _rank_problem(opt, saved) if _is_place(saved) else None
        if window is not None and saved is None:  # written before windows recorded a rank
            problem = (
                "Accumulate.load_state_dict: the checkpoint's open window records no rank "
                "(written before accumopt recorded it), and every rank is loading it: it is one "
                f"rank's partial gradient and items, wrong on the others. {_OWN}"
            )
        if not all_ranks(problem is None):
            raise ValueError(
                problem
                or "Accumulate.load_state_dict: another rank refused the checkpoint's open "
                f"window, saved by one rank (here: {saved!r}) and loaded on every rank (see "
                f"that rank's error): its partial gradient and items are one rank's. {_OWN}"
            )

    return hook


def _is_place(place: Any) -> bool:
    """Whether ``place`` is ``[rank, ranks]`` as :func:`state_dict` writes it."""
    if not isinstance(place, (list, tuple)) or len(place) != 2:
        return False
    rank, ranks = place
    return positive_int(ranks) and isinstance(rank, int) and 0 <= rank < ranks


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


def getstate(opt: AccumulatingOptimizer) -> dict[str, Any]:
    """What ``copy.deepcopy`` and pickling keep of a wrapper. A whitelist: an LR scheduler
    patches ``step`` on the instance with a closure over a weakref, which must neither be
    pickled nor shared by a deep copy."""
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

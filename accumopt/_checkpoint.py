"""The wrapper's checkpoint format: ``state_dict``, ``load_state_dict``, copies. Its entry, the
``torch.save`` bytes of a format 4 dict in the inner optimizer's param group 0 (:func:`key_for`),
travels every path a state dict takes (DCP too); an open window's ``.grad`` and buffer sums resume
bit for bit. A stale entry (its ``"fingerprint"``: the bare optimizer trained on) is ignored."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import numbers
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

from accumopt import _grads
from accumopt._state import SAVED, Phase, State, reaches
from accumopt.distributed import local_shard, shard_like

if TYPE_CHECKING:
    from accumopt.accumulate import Accumulate

KEY = "accumopt"
FORMAT = 4
_LOG = logging.getLogger("accumopt")
_STALE = (
    "Accumulate.load_state_dict: ignored the accumopt entry (saved after %s update(s)) of a state "
    "dict whose inner optimizer trained on without the wrapper; the window starts fresh."
)
_LOAD = "Accumulate.load_state_dict: the checkpoint's"
_UNCHANGED = "Nothing was changed."
_INTACT = "Load an intact checkpoint; nothing was changed."
_WINDOW = ("every", "every_items", "reduction", "scheduled")  # the window settings an entry holds


def checkpoint_position(state_dict: Any) -> tuple[int, int] | None:
    """``(updates, micro_steps)`` the wrapper's entry in ``state_dict`` was saved at (the same
    on every rank; None for a bare optimizer's), to tell which save a per-rank file belongs to.
    ValueError: the entry cannot be read, or is of another format."""
    if (entry := entry_of(state_dict)) is None:
        return None
    state = entry.get("state") or {}
    return int(state.get("updates", 0)), int(state.get("micro_step", 0))


def key_for(rank: int) -> str:
    """The param-group key of rank ``rank``'s entry."""
    return KEY if rank == 0 else f"{KEY}.rank{rank}"


def entry_of(state_dict: Any, rank: int = 0) -> dict[str, Any] | None:
    """The wrapper's entry (unpacked) in a state dict: rank ``rank``'s, else rank 0's, else the
    first there; None for a bare optimizer's. ValueError: unreadable, or of another format."""
    if isinstance(state_dict, dict) and isinstance(state_dict.get(KEY), dict):
        raise ValueError(
            f"{_LOAD} accumopt entry is in the format of accumopt 0.1, not {FORMAT}. Resume with "
            "0.1 and save at a boundary, or load the inner optimizer's state alone (no 'accumopt')."
        )
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    group = groups[0] if groups and isinstance(groups[0], dict) else {}
    keys = [key_for(rank), KEY, *sorted(k for k in group if str(k).startswith(f"{KEY}.rank"))]
    packed = next((group[k] for k in keys if group.get(k) is not None), None)
    if packed is None:
        return None
    try:
        entry = torch.load(io.BytesIO(packed), map_location="cpu", weights_only=True)
        fmt = entry.get("format", entry.get("version"))  # format 1 called it "version"
    except Exception as err:
        raise ValueError(
            f"{_LOAD} accumopt entry cannot be read ({type(err).__name__}: {err}); expected the "
            f"bytes Accumulate.state_dict() writes. {_INTACT}"
        ) from err
    if fmt != FORMAT:
        raise ValueError(
            f"{_LOAD} accumopt entry has format {fmt!r}, not {FORMAT}. Load it with the accumopt "
            "that wrote it and save at a boundary, or load the inner optimizer's state alone."
        )
    return entry  # type: ignore[no-any-return]


def _window(opt: Accumulate) -> tuple[Any, ...]:
    """``opt``'s values of the :data:`_WINDOW` settings (a callable window size as None)."""
    sizes = [None if callable(size) else size for size in opt._rules.spec()]
    return (*sizes, opt.reduction, opt._rules.schedule is not None)


def pack(entry: dict[str, Any]) -> bytes:
    """``entry`` as the bytes :func:`state_dict` saves (a DTensor as this rank's local shard)."""
    buffer = io.BytesIO()
    torch.save(tree_map_only(Tensor, local_shard, entry), buffer)
    return buffer.getvalue()


def state_dict(opt: Accumulate) -> dict[str, Any]:
    """The inner optimizer's state dict with the wrapper's entry. RuntimeError, changing
    nothing: a pass or call failed part-way, a micro-step waits, or FSDP2 holds the window."""
    opt.check_usable("state_dict")
    s = opt._state
    open_window = s.micro_step and s.phase is Phase.OPEN
    if opt._sync.fsdp and open_window and not opt.reduce_every_micro_step:
        raise RuntimeError(
            f"Accumulate.state_dict: the open window ({s.micro_step} micro-step(s)) of this FSDP2 "
            "model is held by FSDP2 itself, unreduced, where no state dict reaches. Save when "
            "opt.micro_step == 0 or opt.will_update, or use reduce_every_micro_step=True."
        )
    if open_window and (problem := opt._guard.wiped()) is not None:
        raise RuntimeError(f"{problem} Nothing was saved.")  # a resumed run would train on it
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    state = opt.optimizer.state_dict()
    held = _grads.params_of(opt.param_groups) if s.micro_step else []  # the window's parameters
    sums = opt._buffer.sums
    save_schedule = getattr(opt._rules.schedule, "state_dict", None)
    entry: dict[str, Any] = {
        "format": FORMAT,
        **dict(zip(_WINDOW, _window(opt))),
        "state": {**{f: getattr(s, f) for f in SAVED}, "closed": s.phase is Phase.CLOSED},
        "found_inf": s.found_inf,
        "rank": [opt._sync.rank, opt._sync.world_size],
        "grads": {i: p.grad for i, p in enumerate(held) if p.grad is not None},
        "sums": {i: sums[p] for i, p in enumerate(held) if p in sums},
        "buffer_all": opt._buffer.buffer_all,
        "unfolded": opt._buffer.unfolded if s.micro_step else 0,
        "schedule_state": save_schedule() if callable(save_schedule) else None,
        "noise_scale": None if opt.noise_scale is None else opt.noise_scale.state_dict(),
        "fingerprint": _fingerprint(state),
    }
    entry["state"]["items"] = float(s.items)  # item counts summed as a tensor: read here
    state["param_groups"][0][key_for(opt.rank)] = pack(entry)
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, state)
        if result is not None:
            state = result
    return state


def load_state_dict(opt: Accumulate, state_dict: dict[str, Any]) -> None:
    """Load a state dict from :func:`state_dict`, or a bare inner optimizer's (a fresh window),
    all checked first (TypeError: not a dict; ValueError: an entry of another format, damaged,
    or a window saved with other settings, shapes or ranks); ``.grad`` is cleared first."""
    if not isinstance(state_dict, dict):
        check(opt, state_dict)  # the TypeError
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    got = check(opt, state_dict, warn=True) or {}
    params = _grads.params_of(opt.param_groups)
    inner = {**state_dict, "param_groups": [dict(g) for g in state_dict["param_groups"]]}
    for key in [k for k in inner["param_groups"][0] if str(k).startswith(KEY)]:
        del inner["param_groups"][0][key]
    noise = got.get("noise_scale")
    if noise is not None and opt.noise_scale is not None:
        noise = opt.noise_scale.read_state(noise)  # ValueError where damaged
    undo = _load_schedule_state(opt, got.get("schedule_state"))
    try:
        opt.optimizer.load_state_dict(inner)
    except BaseException:
        undo()
        raise
    opt.param_groups, opt.state = opt.optimizer.param_groups, opt.optimizer.state
    opt.param_groups[0][key_for(opt.rank)] = None
    s, saved = opt._state, got.get("state", {})
    s.updates, s.items_seen = int(saved.get("updates", 0)), float(saved.get("items_seen", 0.0))
    if noise is not None and opt.noise_scale is not None:
        opt.noise_scale.__dict__.update(noise)
    window = bool(saved.get("micro_step"))
    try:
        opt._drop_window(release=False)  # .grad cleared, sizes asked (a schedule may raise)
    except BaseException:
        if window:  # the checkpoint's window is not restored: refuse until another load
            opt._break("an earlier load_state_dict() failed part-way")
        raise
    if window:  # resume the checked open window into the empty one
        s.phase = Phase.BROKEN
        s.micro_step, s.items = int(saved["micro_step"]), float(saved["items"])
        s.weighted, s.stepped = saved["weighted"], saved["stepped"]
        s.size = None if saved["size"] is None else float(saved["size"])
        s.found_inf = None if got["found_inf"] is None else got["found_inf"].clone()
        with torch.no_grad():
            for i, g in got["grads"].items():
                params[i].grad = shard_like(g, params[i])
        sums = {i: shard_like(t, params[i]) for i, t in got["sums"].items()}
        opt._buffer.restore({**got, "sums": sums}, params, saved["closed"])
        opt._sync.restored(s)
        s.phase = Phase.CLOSED if saved["closed"] else Phase.OPEN
        opt._plan()
        if not saved["closed"]:  # a wipe before the close is refused; the rates are not noted
            opt._guard.note_grads(opt._in_grad())  # (a scheduler is often loaded after)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def check(opt: Accumulate, state_dict: Any, warn: bool = False) -> dict[str, Any] | None:
    """The entry ``opt`` loads from ``state_dict`` (None: none, or a stale one, logged with
    ``warn``), checked; raises as :func:`load_state_dict`."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        got = type(state_dict).__qualname__
        if isinstance(state_dict, dict):
            got = f"a dict of the keys {sorted(map(str, state_dict))}"
        raise TypeError(
            f"Accumulate.load_state_dict: got {got}; expected the dict returned by "
            "state_dict() (or by a bare torch.optim optimizer), with 'state' and 'param_groups'."
        )
    entry = entry_of(state_dict, opt.rank)
    if entry is None or entry.get("fingerprint") != _fingerprint(state_dict):
        if entry is not None and warn:
            _LOG.warning(_STALE, entry.get("state", {}).get("updates"))
        return None
    state = entry.get("state")  # refused below: a damaged field, other settings, size or shapes
    fields = {
        "state": isinstance(state, dict),
        "grads": _tensors(entry.get("grads")),
        "sums": _tensors(entry.get("sums")),
        "found_inf": isinstance(entry.get("found_inf"), Tensor | None),
        "rank": _is_place(entry.get("rank")),
        "unfolded": _count(entry.get("unfolded")),
    }
    if isinstance(state, dict):
        fields |= {
            "micro_step": _count(state.get("micro_step")),
            "items": _amount(state.get("items")),
            "weighted": state.get("weighted") in (None, True, False),
            "stepped": isinstance(state.get("stepped"), bool),
            "closed": isinstance(state.get("closed"), bool),
            "updates": _count(state.get("updates")),
            "items_seen": _amount(state.get("items_seen")),
            "size": state.get("size") in (None, math.inf) or _amount(state.get("size")),
        }
    bad = [name for name, ok in fields.items() if not ok]
    if bad:
        raise ValueError(
            f"{_LOAD} accumopt entry has bad {', '.join(bad)}: it was changed or damaged. {_INTACT}"
        )
    assert isinstance(state, dict)
    if not state["micro_step"]:
        return entry
    here = [opt._sync.rank, opt._sync.world_size]
    if list(entry["rank"]) != here:
        raise ValueError(
            f"{_LOAD} open window was saved by rank {entry['rank'][0]} of {entry['rank'][1]}, "
            f"and is loaded on rank {here[0]} of {here[1]}. Load each rank's own. {_UNCHANGED}"
        )
    rules, saved, ours = opt._rules, tuple(entry.get(k) for k in _WINDOW), _window(opt)
    scheduled = bool(saved[3] or ours[3])
    if scheduled:  # the kind of window must match; the size is restored
        saved, ours = [(w[0] is None, w[1] is None, *w[2:]) for w in (saved, ours)]
    if saved != ours:
        raise ValueError(
            f"{_LOAD} open window was saved with (every, every_items, reduction)={saved[:3]!r}, "
            f"this wrapper has {ours[:3]!r}{' (a schedule)' if scheduled else ''}. Rebuild it so, "
            f"or save at a boundary. {_UNCHANGED}"
        )
    size = state["size"]
    full = reaches(state["micro_step"], state["items"], size, rules.in_items)
    probe = State(updates=state["updates"], items_seen=state["items_seen"])
    sized = size is not None and (rules.schedule is None or rules.size_problem(size, probe) is None)
    if not sized or full != state["closed"]:
        raise ValueError(
            f"{_LOAD} window of size {size!r} has micro_step={state['micro_step']!r}, items="
            f"{state['items']!r}, closed={state['closed']!r}: it was changed or damaged. {_INTACT}"
        )
    params = _grads.params_of(opt.param_groups)
    for i, tensor in [*entry["grads"].items(), *entry["sums"].items()]:
        if i >= len(params) or tuple(tensor.shape) != tuple(local_shard(params[i]).shape):
            have = f"shape {tuple(params[i].shape)}" if i < len(params) else "no such one"
            raise ValueError(
                f"{_LOAD} window holds a gradient of shape {tuple(tensor.shape)} for parameter "
                f"{i}, this optimizer has {have}; expected the model, parameter groups and "
                f"sharding it was saved with. {_UNCHANGED}"
            )
    for i, tensor in entry["grads"].items():  # .grad takes its parameter's dtype only
        if tensor.dtype != params[i].dtype:
            raise ValueError(
                f"{_LOAD} window holds a {tensor.dtype} gradient for parameter {i}, which is "
                f"{params[i].dtype} here; expected the model in the dtype it was saved in "
                f"(model.to(dtype) after the load), or a checkpoint saved at a boundary. "
                f"{_UNCHANGED}"
            )
    return entry


def _load_schedule_state(opt: Accumulate, state: Any) -> Any:
    """Load the window schedule's own state first (user code): one that raises is undone from
    a copy and refused (ValueError). Returns the undo, for a failure of what loads after."""
    schedule = opt._rules.schedule
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
            f"{_LOAD} schedule state {str(state)[:200]} does not load into {schedule!r} "
            f"({type(err).__name__}: {err}): it was changed or damaged. {_INTACT}"
        ) from None
    return undo


_SETTINGS = ("max_grad_norm", "scaler", "buffer", "nonfinite", "model", "reduce_every_micro_step")


def getstate(opt: Accumulate) -> dict[str, Any]:
    """What ``copy.deepcopy`` and pickling keep of a wrapper, a whitelist (an LR scheduler's
    closure on ``step`` must be neither pickled nor shared); RuntimeError as :func:`state_dict`."""
    opt.check_usable("copy (deepcopy or pickle)")
    every, every_items = opt._rules.spec()
    settings = {name: getattr(opt, name) for name in _SETTINGS}
    params = _grads.params_of(opt.param_groups)
    return {
        "optimizer": opt.optimizer,
        "settings": {**settings, "every": every, "every_items": every_items},
        "reduction": opt.reduction,
        "noise_scale": opt.noise_scale,
        "state": opt._state,
        "grads": [p.grad for p in params] if opt._state.micro_step else None,
        "buffer": opt._buffer,
    }


def setstate(opt: Accumulate, state: dict[str, Any]) -> None:
    """Rebuild a wrapper from :func:`getstate` (its own hooks, the copied window)."""
    settings = dict(state["settings"])
    every = settings.pop("every")
    noise = False if state["noise_scale"] is None else state["noise_scale"]
    type(opt).__init__(
        opt, state["optimizer"], every, reduction=state["reduction"], noise_scale=noise, **settings
    )
    saved: Any = state["state"]
    for name in saved.__slots__:
        setattr(opt._state, name, getattr(saved, name))
    opt._buffer = state["buffer"]
    opt._buffer.forget_params()
    if state["grads"] is not None:
        for p, g in zip(_grads.params_of(opt.param_groups), state["grads"]):
            p.grad = g
    opt._plan()
    if opt._state.micro_step and opt._state.phase is Phase.OPEN:  # a wipe of the copy too
        opt._guard.note_grads(opt._in_grad())


def dcp_init_step(opt: Accumulate) -> bool:
    """Whether this ``step()`` is ``torch.distributed.checkpoint``'s optimizer-state
    initialisation (an empty inner state, every lr 0, every trainable ``.grad`` all zeros);
    if so, run it: the inner optimizer steps once, uncounted, and the zero gradients go."""
    inner, s = opt.optimizer, opt._state
    if inner.state or any(float(g.get("lr", 0.0)) != 0.0 for g in opt.param_groups):
        return False
    params = [p for p in _grads.params_of(opt.param_groups) if p.requires_grad]
    for p in params:
        if p.grad is None or (grad := local_shard(p.grad)).is_sparse or bool(grad.any()):
            return False
    if params and not s.micro_step:
        counts = s.updates, s.items_seen, s.did_update
        s.phase = Phase.APPLY
        try:
            inner.step()
        finally:
            s.updates, s.items_seen, s.did_update = counts
            s.phase = Phase.OPEN
    for p in params:
        p.grad = None
    return bool(params)


def _fingerprint(state_dict: dict[str, Any]) -> list[float]:
    """What tells a stale entry: each param group's learning rate, and the sum of the inner
    state's ``"step"`` counts (the same on every rank)."""
    lrs = [g.get("lr") for g in state_dict.get("param_groups") or []]
    marks = [float(lr) if isinstance(lr, (float, int, Tensor)) else -1.0 for lr in lrs]
    steps = [v.get("step") for v in (state_dict.get("state") or {}).values() if isinstance(v, dict)]
    return [*marks, float(sum(float(local_shard(t)) for t in steps if t is not None))]


def _count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= 0


def _amount(value: Any) -> bool:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and math.isfinite(value) and value >= 0


def _tensors(v: Any) -> bool:
    return isinstance(v, dict) and all(_count(i) and isinstance(t, Tensor) for i, t in v.items())


def _is_place(place: Any) -> bool:
    pair = isinstance(place, (list, tuple)) and len(place) == 2
    return pair and _count(place[0]) and _count(place[1]) and place[0] < place[1]

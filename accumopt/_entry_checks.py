"""Whether a checkpoint's ``"accumopt"`` entry (``_checkpoint``'s format) fits the wrapper
loading it: every field of the right type (a damaged or edited checkpoint is refused before
anything is loaded), an open window saved with the same settings, parameter shapes, rank and
number of ranks. All of it runs before ``load_state_dict`` changes anything."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from accumopt._checks import positive_int
from accumopt._window import reaches

if TYPE_CHECKING:
    from accumopt.accumulate import AccumulatingOptimizer

KEY = "accumopt"
_READABLE = (1, 2, 3)


def format_of(extra: dict[str, Any]) -> Any:
    """The entry's format number (format 1 called it ``"version"``)."""
    return extra.get("format", extra.get("version"))


def check_entry(
    opt: AccumulatingOptimizer, extra: Any, params: list[Tensor]
) -> dict[str, Any] | None:
    """The checkpoint's open window, if any, after checking that it fits this wrapper."""
    if extra is None:
        return None
    fmt = format_of(extra) if isinstance(extra, dict) else None
    if fmt not in _READABLE:
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint's accumopt entry has format {fmt!r}; "
            f"expected one of {_READABLE} (this accumopt reads those). Load it with the "
            "accumopt version that wrote it, or save at an accumulation boundary and load the "
            "inner optimizer's state alone."
        )
    _check_fields(opt, extra)
    window: dict[str, Any] | None = extra.get("window")
    if window is None:
        return None
    _check_position(window)
    problem = _rank_problem(opt, window.get("rank"))
    if problem is not None:
        raise ValueError(problem)
    saved: tuple[object, ...] = (
        extra.get("every"),
        extra.get("every_items"),
        extra.get("reduction"),
    )
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
    _check_size(opt, window, extra)
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


def _count(value: Any) -> bool:
    """Whether ``value`` is an int >= 0 (a bool is not)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= 0


def _amount(value: Any) -> bool:
    """Whether ``value`` is a finite real number >= 0 (a bool is not)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and math.isfinite(value) and value >= 0


def _tensors(value: Any) -> bool:
    """Whether ``value`` maps parameter indices (ints >= 0) to tensors."""
    return isinstance(value, dict) and all(
        _count(i) and isinstance(t, Tensor) for i, t in value.items()
    )


def _check_fields(opt: AccumulatingOptimizer, extra: dict[str, Any]) -> None:
    """Refuse an entry whose fields are missing or of the wrong type (ValueError naming them),
    before anything is loaded; the noise-scale averages are read as they would be loaded."""
    schedule, window = extra.get("schedule"), extra.get("window")
    problems = {
        "updates": not _count(extra.get("updates")),
        "schedule": schedule is not None
        and not (
            isinstance(schedule, dict)
            and _count(schedule.get("updates"))
            and _amount(schedule.get("items_seen"))
        ),
        "window": window is not None
        and not (
            isinstance(window, dict)
            and _tensors(window.get("grads"))
            and _tensors(window.get("buffer"))
            and isinstance(window.get("found_inf"), Tensor | None)
            and isinstance(window.get("buffer_all", False), bool)
        ),
    }
    bad = [f"{key}={extra.get(key)!r}"[:200] for key, wrong in problems.items() if wrong]
    if bad:
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint's accumopt entry has {', '.join(bad)}; "
            "expected updates an int >= 0, schedule None or {'updates': int >= 0, "
            "'items_seen': finite number >= 0, ...}, window None or a dict whose grads and "
            "buffer map parameter indices to tensors, found_inf None or a tensor, as "
            "state_dict() writes them. The checkpoint was changed or damaged: load an intact "
            "one. Nothing was changed."
        )
    if opt.noise_scale is not None and extra.get("noise_scale") is not None:
        opt.noise_scale.read_state(extra["noise_scale"])  # ValueError where it is damaged


def _check_size(opt: AccumulatingOptimizer, window: dict[str, Any], extra: dict[str, Any]) -> None:
    """Refuse an open window whose size this wrapper cannot have (its schedule's bounds), or
    whose ``closed`` disagrees with its count: a closed one is full, an open one short of its
    size (a closed window short of it would be applied as it is, an open full one grow)."""
    in_items = opt._window.in_items
    size = window.get("size")
    if size is None:  # formats 1-2: the settings it was saved with
        size = extra.get("every_items" if in_items else "every")
    every, every_items = (None, size) if in_items else (size, None)
    micro_step, items = window["micro_step"], window["items"]
    ok = opt._window.size_problem(size) is None and (in_items or micro_step <= size)
    if ok and window["closed"]:
        ok = reaches(micro_step, items, every, every_items)
    elif ok:  # strictly short: a fractional total within the rounding slack of reaches() is
        # open in windows saved before that slack (2026-12-03), and loads as it was
        ok = micro_step < every if every is not None else items < every_items
    if not ok:
        raise ValueError(
            f"Accumulate.load_state_dict: the checkpoint's open window of size {size!r} has "
            f"micro_step={micro_step!r}, items={items!r}, closed={window['closed']!r}; expected "
            "a size this wrapper can have and a window closed exactly when it is full, as "
            "state_dict() writes it. The checkpoint was changed or damaged: load an intact "
            "one. Nothing was changed."
        )


def _check_position(window: dict[str, Any]) -> None:
    """Refuse a window position no wrapper writes (a damaged or edited checkpoint)."""
    problems = {
        "micro_step": not positive_int(window.get("micro_step")),
        "items": not _amount(window.get("items")),
        "weighted": window.get("weighted") not in (None, True, False),
        "closed": not isinstance(window.get("closed"), bool),
        "stepped": not isinstance(window.get("stepped"), bool),
        "unfolded": not _count(window.get("unfolded", 0)),
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

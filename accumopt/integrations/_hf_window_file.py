"""The per-rank window files of :class:`~accumopt.integrations.hf_trainer.AccumulateTrainer`
checkpoints: a checkpoint written mid-window holds each rank's open window in a file of its own
beside the Trainer's ``optimizer.pt`` (which holds the main process's only).

A window file belongs to the save that wrote ``optimizer.pt`` beside it: every save into a
folder first removes this rank's file there (a save at an accumulation boundary writes none),
and a resume checks that the file's position (updates applied, micro-steps in the window) is
the one ``optimizer.pt`` records. A file left by an earlier save (an earlier run writing into
the same ``output_dir``, a rollback) would otherwise load a stale window silently.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from accumopt.accumulate import AccumulatingOptimizer

WINDOW_FILE = "accumopt_window_rank{rank}.pt"
"""Per-rank file, in a checkpoint folder, of a window open when the checkpoint was written."""

_LOG = logging.getLogger("accumopt")
_STALE = (
    "AccumulateTrainer: ignored %s: it holds a window of %d micro-step(s) after %s update(s), "
    "but the checkpoint beside it was written at an accumulation boundary (after %s update(s)): "
    "the file is left over from an earlier save into this folder. Resuming at the boundary."
)
_UNMATCHED = (
    "AccumulateTrainer: ignored %s: the checkpoint beside it has no optimizer.pt with accumopt's "
    "state to match it against (saved with save_only_model, or by a plain Trainer), so it is "
    "left over from another save. Resuming without a window."
)
_MISSING = (
    "AccumulateTrainer: {checkpoint} was written mid-window but has no {path}; expected one "
    "window file per rank (each rank's own partial gradient)."
)
_OTHER_RANK = (
    "AccumulateTrainer: another rank refused the window files of {checkpoint} (its error says "
    "why); every rank stops, so that none trains on alone."
)
_MISMATCH = (
    "AccumulateTrainer: {path} holds a window of {micro} micro-step(s) after {updates} "
    "update(s), but the checkpoint's optimizer.pt was written {main_micro} micro-step(s) into "
    "the window after {main_updates} update(s): the two files come from different saves, so "
    "this checkpoint cannot resume exactly. Resume from another checkpoint, or delete the "
    "window file and the checkpoint's optimizer.pt to start that window afresh."
)


def save(opt: AccumulatingOptimizer, output_dir: str, rank: int, write: Callable[[], None]) -> None:
    """Remove this rank's window file in ``output_dir``, run ``write`` (the Trainer's save of
    ``optimizer.pt`` and the scheduler), then write the file if a window is open."""
    path = os.path.join(output_dir, WINDOW_FILE.format(rank=rank))
    if os.path.isfile(path):  # before optimizer.pt: a save dying half-way leaves no stale file
        os.remove(path)
    write()
    if opt.micro_step > 0:  # each rank's own partial gradient (unsynchronised so far)
        os.makedirs(output_dir, exist_ok=True)
        torch.save(opt.state_dict(), path)


def position(state: Any) -> tuple[Any, int]:
    """(updates, micro-steps in the window) of an ``Accumulate`` state dict (its
    ``"accumopt"`` entry), or of that entry itself."""
    entry = state.get("accumopt", state) if isinstance(state, dict) else None
    if not isinstance(entry, dict):
        return None, 0
    window = entry.get("window")
    micro = window.get("micro_step", 0) if isinstance(window, dict) else 0
    return entry.get("updates"), int(micro)


def without_window(state: Any, seen: list[tuple[Any, int]]) -> Any:
    """``optimizer.pt``'s state dict without its open window (its :func:`position` appended to
    ``seen``): that window is the main process's, and each rank's own comes from its file."""
    entry = state.get("accumopt") if isinstance(state, dict) else None
    if not isinstance(entry, dict):
        return None
    seen.append(position(entry))
    if entry.get("window") is None:
        return None
    return {**state, "accumopt": {**entry, "window": None}}


def load(path: str, seen: list[tuple[Any, int]], device: Any) -> dict[str, Any] | None:
    """This rank's window from ``path`` if it belongs to the ``optimizer.pt`` loaded beside it
    (``seen``: its position, if it was loaded), else None for a stale file of a boundary
    checkpoint or one without accumopt's ``optimizer.pt`` (logged); raises RuntimeError for a
    file of another mid-window save."""
    if not seen:  # no optimizer.pt (save_only_model), or one a plain Trainer wrote
        _LOG.warning(_UNMATCHED, path)
        return None
    saved = torch.load(path, map_location=device, weights_only=True)
    if position(saved) == seen[0]:
        return saved  # type: ignore[no-any-return]
    (updates, micro), (main_updates, main_micro) = position(saved), seen[0]
    if main_micro == 0:
        _LOG.warning(_STALE, path, micro, updates, main_updates)
        return None
    raise RuntimeError(
        _MISMATCH.format(
            path=path,
            micro=micro,
            updates=updates,
            main_micro=main_micro,
            main_updates=main_updates,
        )
    )


def resume(
    checkpoint: str,
    rank: int,
    seen: list[tuple[Any, int]],
    device: Any,
    failed_ranks: Callable[[bool], float] | None,
) -> Any:
    """This rank's window to resume ``checkpoint`` with (:func:`load`), or None. Under DDP
    (``failed_ranks``: the wrapper's ``GradSync.failed_ranks``, one small collective) the ranks
    agree first: where any rank refuses (its file missing beside a mid-window
    ``optimizer.pt``, or of another save), every rank raises, before any training.

    Raises:
        RuntimeError: this rank's refusal, or :data:`_OTHER_RANK`.
    """
    path = os.path.join(checkpoint, WINDOW_FILE.format(rank=rank))
    saved, problem = None, None
    try:
        if os.path.isfile(path):
            saved = load(path, seen, device)
        elif seen and seen[0][1] > 0:  # only the main process's window, in optimizer.pt
            raise RuntimeError(_MISSING.format(checkpoint=checkpoint, path=path))
    except RuntimeError as err:
        problem = err
    if failed_ranks is not None and failed_ranks(problem is not None) > 0 and problem is None:
        problem = RuntimeError(_OTHER_RANK.format(checkpoint=checkpoint))
    if problem is not None:
        raise problem
    return saved

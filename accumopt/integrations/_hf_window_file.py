"""Per-rank window files of ``AccumulateTrainer`` checkpoints: written mid-window, a
checkpoint holds each rank's ``opt.state_dict()`` in :data:`WINDOW_FILE` beside the Trainer's
``optimizer.pt`` (the main process's alone). A file belongs to the save that wrote that
``optimizer.pt``: a save first removes this rank's old file, and a resume checks that both
were saved at the same ``accumopt.checkpoint_position``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from accumopt import Accumulate, checkpoint_position

WINDOW_FILE = "accumopt_window_rank{rank}.pt"
"""A rank's window file in a checkpoint folder."""

_LOG = logging.getLogger("accumopt")
_IGNORED = "AccumulateTrainer: ignored %s: %s. Resuming without its window."
_STALE = (
    "the checkpoint beside it was saved at an update, so the file is left over from an earlier save"
)
_UNMATCHED = "the checkpoint beside it has no optimizer.pt with accumopt's state to match it"
_MISSING = (
    "AccumulateTrainer: {checkpoint} was written mid-window but has no {path}; expected one "
    "window file per rank. Resume from a checkpoint written at an update."
)
_MISMATCH = (
    "AccumulateTrainer: {path} was saved at (updates, micro-steps) {mine}, its checkpoint's "
    "optimizer.pt at {main}: they come from different saves. Resume from another checkpoint."
)
_OTHER_RANK = (
    "AccumulateTrainer: another rank refused the window files of {checkpoint} (its error says "
    "why); every rank stops, so that none trains on alone."
)


def save(opt: Accumulate, output_dir: str, rank: int, write: Callable[[], None]) -> None:
    """Remove this rank's window file in ``output_dir``, run ``write`` (the Trainer's save of
    ``optimizer.pt``), then write the file if a window is open."""
    path = os.path.join(output_dir, WINDOW_FILE.format(rank=rank))
    if os.path.isfile(path):  # first: a save that dies half-way leaves no stale file
        os.remove(path)
    write()
    if opt.micro_step > 0:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(opt.state_dict(), path)


def _without_window(state: Any, seen: list[tuple[int, int]]) -> Any:
    """Load pre-hook for ``optimizer.pt``: note its position in ``seen``; saved mid-window,
    load its inner state alone (each rank's window comes from its own file)."""
    position = checkpoint_position(state)
    if position is None:
        return None
    seen.append(position)
    if position[1] == 0:
        return None
    first = {k: v for k, v in state["param_groups"][0].items() if not str(k).startswith("accumopt")}
    return {**state, "param_groups": [first, *state["param_groups"][1:]]}


def resume(
    opt: Accumulate, checkpoint: str, rank: int, device: Any, load_main: Callable[[], None]
) -> Any:
    """Run ``load_main`` (the Trainer's load of ``optimizer.pt``, its window left out), then
    return rank ``rank``'s window file if it was saved with that ``optimizer.pt``; None where
    there is none, or a stale or unmatched one (logged).

    Raises:
        RuntimeError: the file is missing beside a mid-window ``optimizer.pt`` or comes from
            another save, on this rank or (DDP: the ranks agree first) on another.
    """
    seen: list[tuple[int, int]] = []
    hook = opt.register_load_state_dict_pre_hook(lambda _, state: _without_window(state, seen))
    try:
        load_main()
    finally:
        hook.remove()
    main, path = seen[0] if seen else None, os.path.join(checkpoint, WINDOW_FILE.format(rank=rank))
    saved, problem = None, None
    if not os.path.isfile(path):
        if main is not None and main[1] > 0:
            problem = RuntimeError(_MISSING.format(checkpoint=checkpoint, path=path))
    elif main is None:
        _LOG.warning(_IGNORED, path, _UNMATCHED)
    else:
        saved = torch.load(path, map_location=device, weights_only=True)
        if (mine := checkpoint_position(saved)) != main:
            saved = None
            if main[1] == 0:
                _LOG.warning(_IGNORED, path, _STALE)
            else:
                problem = RuntimeError(_MISMATCH.format(path=path, mine=mine, main=main))
    refused, _ = opt.sum_over_ranks(problem is not None, what="AccumulateTrainer's resume")
    if problem is None and refused:
        problem = RuntimeError(_OTHER_RANK.format(checkpoint=checkpoint))
    if problem is not None:
        raise problem
    return saved

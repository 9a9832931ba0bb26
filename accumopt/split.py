"""Split a nested batch into one piece per device, each moved straight to its device (no
staging on the first GPU, unlike ``torch.nn.DataParallel``'s scatter): :func:`micro_split`."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple, TypeAlias

import torch
from torch import Tensor

from accumopt import _tree
from accumopt._tree import Batch, Broadcast, PerSample

__all__ = ["Batch", "Broadcast", "DeviceLike", "PerSample", "Piece", "micro_split"]

DeviceLike: TypeAlias = str | torch.device | int
"""``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or an int (a CUDA index)."""


class Piece(NamedTuple):
    """One device's share (:func:`micro_split`): ``batch`` in the input's nesting with rows
    ``i:i+size`` of its cut leaves, tensors on ``device``; ``size >= 0`` (0 only with weights)."""

    batch: Batch
    size: int
    device: torch.device


def micro_split(
    batch: Batch, devices: Sequence[DeviceLike], *, weights: Sequence[float] | None = None
) -> list[Piece]:
    """Split ``batch`` along dim 0 into one piece per listed device, and move each piece there.

    What is cut and what goes whole: docs/guide/several-devices.md. Tensors are moved with
    ``.to(device, non_blocking=True)``, a dense CPU slice bound for CUDA pinned first. Without
    ``weights`` sizes differ by at most one row, the first pieces larger (10 rows on 3 devices:
    4, 3, 3); with them piece ``k`` gets ``n * weights[k] / sum(weights)`` rows by largest
    remainder (ties to the earlier device), and a share that rounds to 0 is empty.

    Args:
        batch: a tensor or a nesting whose tensor leaves share ``n >= len(devices)`` rows.
        devices: one per piece: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device`` or an
            int CUDA index; repeats are allowed.
        weights: optional positive finite numbers, one per device: relative shares of rows.

    Returns:
        ``[Piece(batch, size, device), ...]`` in device order, ``sum(size) == n``; dtypes,
        layouts and subclasses kept.

    Raises:
        TypeError: ``devices`` or ``weights`` not a list, a device of another type; a batch
            :func:`accumopt._tree.batch_size` refuses; a leaf torch cannot cut or move.
        ValueError: fewer rows than devices; an unknown device, CUDA not available or an index
            out of range; bad ``weights`` (length, not positive or finite); as ``batch_size``.

    Examples:
        >>> pieces = micro_split({"x": torch.zeros(5, 3), "tag": "train"}, ["cpu", "cpu"])
        >>> [(p.batch["x"].shape[0], p.batch["tag"], p.size) for p in pieces]
        [(3, 'train', 3), (2, 'train', 2)]
        >>> batch = {"img": torch.zeros(4, 3), "txt": ["a", "b", "c", "d"], "size": (1, 2)}
        >>> [(p.batch["txt"], p.batch["size"]) for p in micro_split(batch, ["cpu", "cpu"])]
        [(['a', 'b'], (1, 2)), (['c', 'd'], (1, 2))]
    """
    targets = _check_devices(devices)
    shares = _check_weights(weights, len(targets))
    rows_of = _tree.RowSlicer(batch, None, api="micro_split")
    n = rows_of.rows
    if n < len(targets):
        raise ValueError(
            f"micro_split: the batch has {n} rows for {len(targets)} devices; expected at least "
            "one row per device. List fewer devices, or pass a larger batch."
        )
    quotas = [n * s for s in shares]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda k: sizes[k] - quotas[k])  # stable
    for k in by_remainder[: n - sum(sizes)]:  # largest remainder, ties to the earlier device
        sizes[k] += 1
    starts = itertools.accumulate(sizes, initial=0)
    return [Piece(rows_of.cut(i, i + k, d), k, d) for d, k, i in zip(targets, sizes, starts)]


def _check_devices(devices: object) -> list[torch.device]:
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"micro_split: devices={devices!r} is not a list; expected a list with one device "
            'per piece, e.g. ["cuda:0", "cuda:1"] or ["cpu"].'
        )
    if not devices:
        raise ValueError("micro_split: devices=[] is empty; expected one device at least: ['cpu'].")
    return [parse_device(d, f"micro_split: devices[{k}]={d!r}") for k, d in enumerate(devices)]


def parse_device(device: object, where: str) -> torch.device:
    """``device`` (a str, a ``torch.device`` or an int CUDA index) as a CPU or present CUDA
    device, else TypeError/ValueError starting with ``where`` (the argument as given)."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"{where} is a {type(device).__qualname__}; expected a str such as 'cuda:0', a "
            "torch.device or an int CUDA index."
        )
    if isinstance(device, int) and device < 0:
        raise ValueError(f"{where} is negative; expected a CUDA index >= 0 or a device string.")
    try:
        parsed = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"{where} is not a device; expected 'cpu', 'cuda' or 'cuda:<index>', a torch.device "
            "or an int CUDA index."
        ) from None
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise ValueError(f"{where} has device type {parsed.type!r}; expected 'cpu' or 'cuda'.")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{where} is a CUDA device but CUDA is not available; expected 'cpu' entries on "
            "this machine. Check torch.cuda.is_available()."
        )
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    if index >= (count := torch.cuda.device_count()):
        raise ValueError(
            f"{where} is out of range; expected a CUDA index below "
            f"torch.cuda.device_count()={count}."
        )
    return torch.device("cuda", index)


def _check_weights(weights: object, n_devices: int) -> list[Fraction]:
    """Exact shares (Fractions summing to 1), equal when ``weights`` is None."""
    if weights is None:
        return [Fraction(1, n_devices)] * n_devices
    if isinstance(weights, (str, Tensor)) or not isinstance(weights, Sequence):
        raise TypeError(
            f"micro_split: weights={weights!r} is not a list; expected one positive number per "
            "device, e.g. weights=[2, 1]."
        )
    if len(weights) != n_devices:
        raise ValueError(
            f"micro_split: weights={list(weights)!r} has {len(weights)} entries for {n_devices} "
            "devices; expected one weight per device."
        )
    exact: list[Fraction] = []
    for w in weights:
        ok = isinstance(w, numbers.Real) and not isinstance(w, bool)
        if not ok or not math.isfinite(float(w)) or w <= 0:
            raise ValueError(
                f"micro_split: weights={list(weights)!r} has the entry {w!r}; expected positive "
                "finite numbers (relative shares of the rows, e.g. [2, 1])."
            )
        exact.append(Fraction(w) if isinstance(w, numbers.Rational) else Fraction(float(w)))
    total = sum(exact, Fraction(0))
    return [w / total for w in exact]

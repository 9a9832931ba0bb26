"""Split a nested batch into one piece per device: ``micro_split(batch, devices)``.

Every tensor leaf and every per-sample list is cut along the rows and each piece is moved
straight to its own device (no staging on the first GPU, unlike ``torch.nn.DataParallel``'s
scatter); other leaves are handed to every piece unchanged. No sample is dropped or
duplicated. :class:`PerSample` and :class:`Broadcast` override the rule for one value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, NamedTuple, TypeAlias

import torch
from torch import Tensor

from accumopt import _tree
from accumopt._tree import Broadcast, PerSample

__all__ = ["Batch", "Broadcast", "DeviceLike", "PerSample", "Piece", "micro_split"]

Batch: TypeAlias = Any
"""A tensor, or a nesting (any depth) of dicts, lists, tuples, NamedTuples, Mappings and
dataclasses with tensor leaves (the rules: :mod:`accumopt._tree`)."""

DeviceLike: TypeAlias = str | torch.device | int
"""``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or an int (a CUDA index)."""


class Piece(NamedTuple):
    """One device's share of a batch, as returned by :func:`micro_split`.

    Attributes:
        batch: the same nesting (and container types) as the input batch; tensor leaves and
            per-sample lists hold rows ``i:i+size`` (tensors on ``device``), other leaves are
            the input's objects.
        size: rows (samples) in this piece, an int >= 0 (0 only with ``weights=``).
        device: the device the piece's tensors were moved to.
    """

    batch: Batch
    size: int
    device: torch.device


def micro_split(
    batch: Batch, devices: Sequence[DeviceLike], *, weights: Sequence[float] | None = None
) -> list[Piece]:
    """Split ``batch`` along dim 0 into one piece per listed device, and move each piece there.

    Every tensor leaf is cut to its rows and moved with ``.to(device, non_blocking=True)``;
    a dense CPU slice bound for a CUDA device is pinned first, so the copy is asynchronous.
    Each piece goes straight to its device: nothing is staged on the first GPU. Concatenating
    the pieces leaf by leaf gives the batch back exactly.

    What is cut (the full rules are in :mod:`accumopt._tree`'s docstring):

    - **tensors**, along dim 0: dense ones as views (``leaf[i:j]``), and sparse COO, sparse
      CSR, batched sparse compressed, nested (jagged or strided) and quantized tensors and
      tensor subclasses each their own way; 2-D CSC/BSR/BSC and MKL-DNN tensors are refused;
    - **per-sample sequences**: a ``list`` or ``tuple`` holding no tensor (captions, ids,
      lists of tokens) whose length equals the batch's rows ``n`` gets ``seq[i:j]``; one of
      another length is passed whole, as are other non-tensor leaves (ints, strings, None);
    - **containers**: dict, list, tuple, NamedTuple and other pytree nodes, plus Mapping
      subclasses (``UserDict``, ``transformers.BatchEncoding``) and dataclass instances, which
      each piece gets as the same class;
    - **overrides**: ``PerSample(value)`` is always cut (e.g. a list of tensors of different
      lengths), ``Broadcast(value)`` never (e.g. a tuple that happens to have ``n`` entries).

    Without ``weights`` the sizes differ by at most one row, the first pieces getting the extra
    rows (10 rows on 3 devices: 4, 3, 3). With ``weights`` (e.g. for unequal GPUs) piece ``k``
    gets ``n * weights[k] / sum(weights)`` rows rounded by the largest-remainder method (ties
    to the earlier device), so every size is within one row of its share and the sizes sum to
    ``n``; a device whose share rounds down to 0 gets an empty piece (``size == 0``).

    Args:
        batch: a tensor, or a nesting of any depth as above. All tensor leaves (and
            ``PerSample`` values) must have the same length ``n`` along dim 0, with
            ``n >= len(devices)``.
        devices: one entry per piece, in order: ``"cpu"``, ``"cuda"`` (the current CUDA
            device), ``"cuda:1"``, a ``torch.device``, or an int (CUDA index). A device may
            be listed more than once.
        weights: optional positive finite numbers, one per device: the relative share of rows.

    Returns:
        ``[Piece(batch, size, device), ...]``, one per listed device, in order.

    Shapes:
        leaf ``(n, ...)`` -> piece leaves ``(size_k, ...)`` with ``sum(size_k) == n``; dtypes,
        layouts and tensor subclasses are kept; per-sample sequences of ``n`` -> ``size_k``.

    Raises:
        TypeError: ``devices`` is not a list, or has an entry of another type; no tensor
            leaf in ``batch``; a tensor of a kind whose rows cannot be cut, or that torch
            cannot move; a Mapping or dataclass that cannot be rebuilt; ``weights`` is not a
            list of numbers.
        ValueError: an empty batch, fewer rows than devices, leaves of different lengths, a
            0-dim tensor leaf; an unknown device string, a CUDA device without CUDA or out of
            range; ``weights`` of the wrong length, not positive or not finite.

    Example:
        >>> pieces = micro_split({"x": torch.zeros(5, 3), "tag": "train"}, ["cpu", "cpu"])
        >>> [(p.batch["x"].shape[0], p.batch["tag"], p.size) for p in pieces]
        [(3, 'train', 3), (2, 'train', 2)]
        >>> batch = {"img": torch.zeros(4, 3), "txt": ["a", "b", "c", "d"], "size": (1, 2)}
        >>> [(p.batch["txt"], p.batch["size"]) for p in micro_split(batch, ["cpu", "cpu"])]
        [(['a', 'b'], (1, 2)), (['c', 'd'], (1, 2))]

    References:
        padertorch's trainer (one example per GPU, moved directly to its device) and
        ``torch.nn.DataParallel`` (``scatter``, which stages on the first GPU).
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
    pieces: list[Piece] = []
    start = 0
    for device, size in zip(targets, _sizes(n, shares)):
        pieces.append(Piece(rows_of.cut(start, start + size, device), size, device))
        start += size
    return pieces


def _sizes(n: int, shares: list[Fraction]) -> list[int]:
    """Largest-remainder rounding of ``n * share``; ties go to the earlier piece."""
    quotas = [n * s for s in shares]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda k: (-(quotas[k] - sizes[k]), k))
    for k in by_remainder[: n - sum(sizes)]:
        sizes[k] += 1
    return sizes


def _check_devices(devices: object) -> list[torch.device]:
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"micro_split: devices={devices!r} is not a list; expected a list with one device "
            'per piece, e.g. ["cuda:0", "cuda:1"] or ["cpu"].'
        )
    if not devices:
        raise ValueError(
            "micro_split: devices=[] is empty; expected at least one device, e.g. ['cpu']."
        )
    return [_parse_device(d, k) for k, d in enumerate(devices)]


def _parse_device(device: object, k: int) -> torch.device:
    where = f"devices[{k}]={device!r}"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"micro_split: {where} is a {type(device).__qualname__}; expected a str such as "
            "'cuda:0', a torch.device or an int CUDA index."
        )
    if isinstance(device, int) and device < 0:
        raise ValueError(
            f"micro_split: {where} is negative; expected a CUDA index >= 0 or a device string."
        )
    try:
        parsed = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"micro_split: {where} is not a device; expected 'cpu', 'cuda' or 'cuda:<index>', "
            "a torch.device or an int CUDA index."
        ) from None
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise ValueError(
            f"micro_split: {where} has device type {parsed.type!r}; expected 'cpu' or 'cuda'."
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"micro_split: {where} is a CUDA device but CUDA is not available; expected 'cpu' "
            "entries on this machine. Check torch.cuda.is_available()."
        )
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"micro_split: {where} is out of range; expected a CUDA index below "
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

"""Find the largest micro-batch that fits, during training, from out-of-memory errors alone: per
input shape, double without a failure, halve without a success, else bisect between the largest
size that ran and the smallest that failed (docs/guide/one-big-batch.md)."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Hashable
from dataclasses import dataclass, field

from accumopt._checks import positive_int

logger = logging.getLogger("accumopt")


class NoMicroBatchFits(RuntimeError):
    """Raised when even a micro-batch of one row runs out of memory."""


def describe_key(key: Hashable) -> str:
    """A shape key (``_tree.RowSlicer.shape_key``: per tensor leaf ``(path, shape, dtype)`` or
    ``(shape, dtype)``, the shape past dim 0) as log lines show it; any other key by ``str()``.

    >>> describe_key((("x", (3, 32, 32), "torch.float32"), ("y", (), "int64")))
    'x: (3, 32, 32) float32, y: () int64'
    """
    if not isinstance(key, tuple) or not key:
        return str(key)
    parts = []
    for leaf in key:
        if not (isinstance(leaf, tuple) and len(leaf) in (2, 3) and isinstance(leaf[-2], tuple)):
            return str(key)
        *path, shape, dtype = leaf
        text = f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
        parts.append(f"{path[0]}: {text}" if path else text)
    return ", ".join(parts)


def check_search(
    api: str, name: str, first: object, tolerance: object, grow_after: object, max_size: object
) -> None:
    """ValueError naming ``api`` and the argument for a bad search setting (the first size is
    called ``name``; the runner's ``"start_size"`` may be None)."""
    none = ", or None to start at the whole batch" if name == "start_size" else ""
    if not positive_int(first) and not (none and first is None):
        raise ValueError(
            f"{api}: {name}={first!r} is not an int >= 1; expected the first micro-batch size "
            f"to try, in rows. Pass e.g. {name}=64{none}."
        )
    if isinstance(tolerance, bool) or not (
        isinstance(tolerance, numbers.Real) and 0 <= float(tolerance) < 1  # NaN fails both
    ):
        raise ValueError(
            f"{api}: tolerance={tolerance!r} is not a number in [0, 1); expected the relative gap "
            "where the search stops. Pass e.g. tolerance=0.02, or 0 for the exact largest size."
        )
    for arg, value, meaning in (
        ("grow_after", grow_after, "clean micro-steps before growing the size (None: never)"),
        ("max_size", max_size, "largest micro-batch to try, in rows (None: no cap)"),
    ):
        if value is not None and not positive_int(value):
            raise ValueError(
                f"{api}: {arg}={value!r} is not an int >= 1 or None; expected the {meaning}. "
                "Pass a whole number >= 1, or None."
            )
    if positive_int(first) and positive_int(max_size) and max_size < first:
        raise ValueError(
            f"{api}: max_size={max_size!r} is smaller than {name}={first!r}; expected "
            f"max_size >= {name}. Lower {name} or raise max_size."
        )


@dataclass
class _Bracket:
    fits: int | None = None  # largest size that ran
    fails: int | None = None  # smallest size that ran out of memory
    clean: int = 0  # successes since the last size change


@dataclass
class MicroBatchSizer:
    """The size search (pure Python), one bracket per shape key; ValueError on bad settings.

    Args:
        start: the first size tried for a shape never seen, >= 1.
        tolerance: stop bisecting when ``fails - fits <= max(1, tolerance * fits)`` (0: exact).
        grow_after: clean micro-steps at a settled size before it probes 25 % higher once;
            None never grows back.
        max_size: never propose more than this (None: no cap).

    Attributes: ``ooms`` (failed attempts), ``current`` (where the search stands, or None),
    ``history`` (every size change as (shape key, new size, "first"/"larger"/"smaller")).
    """

    start: int
    tolerance: float = 0.02
    grow_after: int | None = 1000
    max_size: int | None = None
    ooms: int = field(default=0, init=False)
    history: list[tuple[Hashable, int, str]] = field(default_factory=list, init=False)
    current: int | None = field(default=None, init=False)
    _brackets: dict[Hashable, _Bracket] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_search(
            "MicroBatchSizer", "start", self.start, self.tolerance, self.grow_after, self.max_size
        )

    def _settled(self, b: _Bracket) -> bool:
        if b.fits is None or b.fails is None:
            return False
        return b.fails - b.fits <= max(1, math.floor(self.tolerance * b.fits))

    def propose(self, key: Hashable, available: int) -> int:
        """The size to try next for inputs of shape ``key`` with ``available`` rows left."""
        b = self._brackets.get(key)
        if b is None:
            b = self._brackets[key] = _Bracket()
        if b.fits is None:
            size = self.start if b.fails is None else max(1, b.fails // 2)
        elif b.fails is None:  # grow, but never past what this batch can test
            size = min(b.fits * 2, max(b.fits, available))
        else:
            size = b.fits if self._settled(b) else (b.fits + b.fails) // 2
        size = max(1, size if self.max_size is None else min(size, self.max_size))
        if size != self.current:  # a change of the search, not a short remainder of a batch
            was = self.current
            change = f"starts at {size}" if was is None else f"{was} -> {size}"
            logger.info("micro-batch size %s for inputs %s", change, describe_key(key))
            reason = "first" if was is None else "larger" if size > was else "smaller"
            self.history.append((key, size, reason))
            self.current = size
        return min(size, available)

    def succeeded(self, key: Hashable, size: int) -> None:
        """Record that a micro-batch of ``size`` rows ran for shape ``key``."""
        b = self._brackets[key]
        if b.fits is None or size > b.fits:
            b.fits, b.clean = size, 0
        b.clean += 1
        if self.grow_after is not None and b.clean >= self.grow_after and self._settled(b):
            b.fails, b.clean = max(b.fits + 1, math.ceil(1.25 * b.fails)), 0  # type: ignore[operator]
            logger.info("probing larger sizes than %d for inputs %s", b.fits, describe_key(key))

    def proven(self, key: Hashable, size: int) -> bool:
        """Whether ``size`` rows ran for shape ``key`` since memory last got scarcer."""
        b = self._brackets.get(key)
        return b is not None and b.fits is not None and size <= b.fits

    def failed(self, key: Hashable, size: int) -> None:
        """Record an out-of-memory error at ``size`` rows for shape ``key``; raise
        :class:`NoMicroBatchFits` at 1 row (nothing smaller to try)."""
        self.ooms += 1
        b = self._brackets[key]
        b.fails, b.clean = size if b.fails is None else min(b.fails, size), 0
        if b.fits is not None and b.fits >= size:
            b.fits = None  # memory got scarcer: a size that used to run no longer does
        shape = describe_key(key)
        logger.warning("out of memory at micro-batch size %d for inputs %s", size, shape)
        if size <= 1:
            raise NoMicroBatchFits(
                "accumopt: a micro-batch of 1 sample ran out of memory; nothing smaller fits. "
                "Free memory (activation checkpointing, bf16 autocast) or shorten the inputs."
            )

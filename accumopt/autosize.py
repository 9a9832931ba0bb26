"""Find the largest micro-batch that fits, during training, from out-of-memory errors alone.

The search is a bracket per input shape: the largest size that ran (``fits``) and the smallest
that ran out of memory (``fails``). Without a failure yet it grows by doubling; without a
success yet it halves the failing size; with both it bisects, and stops once the bracket is
within ``tolerance`` of the size that fits. Every attempt that succeeds is a real micro-batch of
training (nothing is wasted); only the failed attempts cost work. After ``grow_after`` clean
micro-steps at a settled size the ceiling is raised by 25 % and probed once, so a transient
memory squeeze does not shrink the micro-batch for good.

Compared with the peers: Accelerate's ``find_executable_batch_size`` multiplies by 0.9 and
restarts the training function; Lightning's batch-size finder searches before training
(power or binsearch) and changes the effective batch; Composer and toma halve and never grow.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Hashable
from dataclasses import dataclass, field

from accumopt._checks import positive_int

logger = logging.getLogger("accumopt")


def describe_key(key: Hashable) -> str:
    """A size-search shape key as log lines show it: ``x: (3, 32, 32) float32, y: () int64``.

    Takes the keys of ``_tree.RowSlicer.shape_key``: a tuple with one entry per tensor leaf, either
    ``(shape, dtype)``, written ``(3, 32, 32) float32``, or ``(path, shape, dtype)``, written
    ``path: (3, 32, 32) float32``. The shape is the leaf's shape past dim 0 (``()``: one
    number per row); the dtype may be a string or a ``torch.dtype``. Any other key is written
    with ``str()``, so a log line never fails on an unexpected key.

    >>> describe_key((((3, 32, 32), "torch.float32"), ((), "torch.int64")))
    '(3, 32, 32) float32, () int64'
    >>> describe_key((("x", (3, 32, 32), "torch.float32"), ("y", (), "torch.int64")))
    'x: (3, 32, 32) float32, y: () int64'
    >>> describe_key("text")
    'text'
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
    api: str,
    start: tuple[str, object],
    tolerance: object = 0.0,
    grow_after: object = None,
    max_size: object = None,
) -> None:
    """Refuse nonsensical settings of the size search, naming ``api`` and the argument.

    ``start`` is ``(name, value)``: ``("start", n)`` for :class:`MicroBatchSizer`,
    ``("start_size", n)`` for the runner, where None (the whole batch) is allowed too.

    Raises:
        ValueError: the start is not an int >= 1 (or None where allowed); ``tolerance`` is not
            a number in [0, 1); ``grow_after`` or ``max_size`` is not None or an int >= 1;
            ``max_size`` is smaller than the start.
    """
    start_name, first = start
    optional = start_name == "start_size"
    if not positive_int(first) and not (optional and first is None):
        raise ValueError(
            f"{api}: {start_name}={first!r} is not an int >= 1; expected the first micro-batch "
            f"size to try, in rows. Pass e.g. {start_name}=64"
            + (", or None to start at the whole batch." if optional else ".")
        )
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, numbers.Real)
        or not 0 <= float(tolerance) < 1  # NaN fails both comparisons
    ):
        raise ValueError(
            f"{api}: tolerance={tolerance!r} is not a number in [0, 1); expected the relative gap "
            "at which the search stops bisecting. Pass e.g. tolerance=0.02 (within 2 %), or 0 "
            "for the exact largest size."
        )
    _optional_size(
        api,
        "grow_after",
        grow_after,
        "clean micro-steps at a settled size before a larger size is probed (None: never)",
    )
    _optional_size(api, "max_size", max_size, "largest micro-batch to try, in rows (None: no cap)")
    if positive_int(first) and positive_int(max_size) and max_size < first:
        raise ValueError(
            f"{api}: max_size={max_size!r} is smaller than {start_name}={first!r}; expected "
            f"max_size >= {start_name} (no micro-batch is ever larger than max_size). Lower "
            f"{start_name} or raise max_size."
        )


def _optional_size(api: str, name: str, value: object, meaning: str) -> None:
    if value is not None and not positive_int(value):
        raise ValueError(
            f"{api}: {name}={value!r} is not an int >= 1 or None; expected the {meaning}. "
            f"Pass a whole number >= 1, or None."
        )


class NoMicroBatchFits(RuntimeError):
    """Raised when even a micro-batch of the smallest size runs out of memory."""


@dataclass
class _Bracket:
    fits: int | None = None  # largest size that ran
    fails: int | None = None  # smallest size that ran out of memory
    clean: int = 0  # successes since the last size change


@dataclass
class MicroBatchSizer:
    """The size-search state machine (pure Python, no torch), one bracket per shape key.

    Args:
        start: the first size tried for a shape never seen (e.g. the whole batch), >= 1.
        tolerance: stop bisecting when ``fails - fits <= max(1, tolerance * fits)``;
            0 searches to the exact largest size (a few more failed attempts).
        grow_after: clean micro-steps at a settled size after which the ceiling is raised by
            25 % and probed once; None never grows back.
        max_size: never propose more than this (None: no cap besides the rows at hand).

    Attributes:
        ooms (int): out-of-memory errors seen (failed attempts).
        history (list[tuple[Hashable, int, str]]): every size change as (shape key, new size,
            reason), in order.
        current (int | None): the size the search is at (the last micro-batch of a batch may
            be shorter: it takes the rows that are left).
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
            "MicroBatchSizer", ("start", self.start), self.tolerance, self.grow_after, self.max_size
        )

    def propose(self, key: Hashable, available: int) -> int:
        """The size to try next for inputs of shape ``key`` with ``available`` rows left."""
        b = self._brackets.setdefault(key, _Bracket())
        if b.fits is None:
            size = self.start if b.fails is None else max(1, b.fails // 2)
        elif b.fails is None:  # grow, but never past what this batch can test
            size = min(b.fits * 2, max(b.fits, available))
        elif b.fails - b.fits > max(1, math.floor(self.tolerance * b.fits)):
            size = (b.fits + b.fails) // 2
        else:
            size = b.fits
        if self.max_size is not None:
            size = min(size, self.max_size)
        size = max(1, size)
        if size != self.current:  # a change of the search, not a short remainder of a batch
            reason = (
                "first"
                if self.current is None
                else ("larger" if size > self.current else "smaller")
            )
            self.history.append((key, size, reason))
            if self.current is None:
                logger.info("micro-batch size starts at %d for inputs %s", size, describe_key(key))
            else:
                logger.info(
                    "micro-batch size %d -> %d for inputs %s", self.current, size, describe_key(key)
                )
            self.current = size
        return min(size, available)

    def succeeded(self, key: Hashable, size: int) -> None:
        """Record that a micro-batch of ``size`` rows ran for shape ``key``."""
        b = self._brackets[key]
        if b.fits is None or size > b.fits:
            b.fits, b.clean = size, 0
        b.clean += 1
        settled = b.fails is not None and b.fails - b.fits <= max(
            1, math.floor(self.tolerance * b.fits)
        )
        if settled and self.grow_after is not None and b.clean >= self.grow_after:
            b.fails = max(b.fits + 1, math.ceil(1.25 * b.fails))  # type: ignore[operator]
            b.clean = 0
            logger.info(
                "%d clean micro-steps at %d for inputs %s; probing larger sizes",
                self.grow_after,
                b.fits,
                describe_key(key),
            )

    def proven(self, key: Hashable, size: int) -> bool:
        """Whether ``size`` rows ran for shape ``key`` since memory last got scarcer: at most
        the largest size that ran, with no out-of-memory error at that size or below since."""
        b = self._brackets.get(key)
        return b is not None and b.fits is not None and size <= b.fits

    def failed(self, key: Hashable, size: int) -> None:
        """Record an out-of-memory error at ``size`` rows for shape ``key``.

        Raises:
            NoMicroBatchFits: ``size`` is 1 (nothing smaller to try).
        """
        self.ooms += 1
        b = self._brackets[key]
        b.fails = size if b.fails is None else min(b.fails, size)
        b.clean = 0
        if b.fits is not None and b.fits >= size:
            b.fits = None  # memory got scarcer: a size that used to run no longer does
        logger.warning(
            "out of memory at micro-batch size %d for inputs %s", size, describe_key(key)
        )
        if size <= 1:
            raise NoMicroBatchFits(
                "accumopt: a micro-batch of 1 sample ran out of memory; nothing smaller fits. "
                "Free memory (a smaller model, activation checkpointing, bf16 autocast, a "
                "device with more memory) or shorten the inputs."
            )

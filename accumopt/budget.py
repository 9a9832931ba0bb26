"""Cut a batch's rows into micro-batches by a budget on their cost (tokens, usually): the
planning half of ``MicroBatchRunner(..., budget=TokenBudget(...))``, pure Python on host data.

The rules (docs/guide/one-big-batch.md, "Micro-batches cut by a token budget"):

- Windows first. The rows are cut into windows where the wrapper's window fills (rows
  counted one each for ``rows_per_update``, items for ``every_items``): a window's rows do
  not depend on the budget, the order or the search, so neither do the updates.
- A micro-batch costs ``rows x L`` when ``padded`` (``L``: its longest row's cost rounded up
  to a bucket, at most the batch's padded length) or the sum of its rows' costs (packed).
- Within a window the rows keep their order (contiguous micro-batches) or, with ``sort``, go
  longest first, but for a window in items that ends here its last row (the one whose items
  reach the total) stays last: the wrapper, which closes on the total, closes the window at
  its last micro-batch and not before. Each micro-batch takes as many of the next rows as fit
  the budget (a row costlier than the budget runs alone), their number rounded down to a
  power of two when ``buckets`` is set.
- Ranks: every rank runs as many micro-batches per window as the rank that needs most; the
  others split their costliest micro-batches in half until they have as many.
"""

from __future__ import annotations

import dataclasses
import numbers
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

import torch
from torch import Tensor

from accumopt._checks import positive_int

Buckets: TypeAlias = "Literal['pow2'] | tuple[int, ...] | None"
"""``TokenBudget.buckets`` once validated (a list of lengths: a sorted tuple)."""
Ends: TypeAlias = "Callable[[int], tuple[int, bool]]"
"""Where a window opening at a row ends (:func:`window_end`), asked when it opens."""


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """How :class:`accumopt.MicroBatchRunner` cuts micro-batches by a budget on their cost
    (``budget=TokenBudget(...)``; docs/guide/one-big-batch.md).

    Example (the cuts it makes: :func:`plan`):
        >>> spec = TokenBudget(16, cost=lambda batch: batch["lengths"], padded=True)
        >>> spec.tokens, spec.buckets
        (16, 'pow2')

    Args:
        tokens: the budget of one micro-batch in the unit of ``cost`` (an int >= 1), or
            ``"auto"``: the largest that fits, found from out-of-memory errors (the runner's
            ``start_size``, ``tolerance``, ``grow_after`` and ``max_size`` are in that unit).
        cost: ``cost(batch)`` -> each row's cost: a 1-D integer tensor (on the host: no sync)
            or a sequence of ints >= 0 (e.g. its tokens), one per row; called once per runner
            call, with the batch as given. A row costs at least 1.
        padded: required. True: a micro-batch costs its rows x its padded length (its
            longest row's cost rounded up to a bucket), and the batch's tensor leaves padded
            along dim 1 are cut to that length (``trim``); False: the sum of its rows' costs
            (packed or varlen batches; nothing is cut).
        items: ``items(batch)`` -> each row's items, the weight of its loss (ints >= 0, e.g.
            loss-bearing tokens ``(batch["labels"] != -100).sum(1)``), read once per call
            like ``cost``; None: one item per row. ``loss_fn`` then returns only its loss.
        sort: run each window's rows longest first (less padding, the same update; BatchNorm:
            docs/guide/one-big-batch.md); refused with ``return_outputs=True``.
        rows_per_update: end each window after exactly this many rows over all ranks (with
            ``Accumulate(..., every_items=math.inf)``, the runner flushes it), weighted by
            ``items``; None: the wrapper's ``every_items`` ends it.
        buckets: ``"pow2"`` (default): padded lengths rounded up to a power of two and row
            counts down to one; a sequence of ints: the padded lengths allowed (rows still
            powers of two); None: every micro-batch its exact shape.
        trim: with ``padded``, the leaves padded along dim 1 (cut to a micro-batch's padded
            length), named by key, attribute or index (``("input_ids", "labels")``); None
            (default): every dense leaf of 2+ dims as long along dim 1 as the longest, and a
            leaf that could be padded but is shorter is refused. A per-row feature exactly as
            wide as the padded length is cut too: name the padded leaves then.

    Raises:
        TypeError: ``cost`` or ``items`` not callable; ``padded`` or ``sort`` not a bool.
        ValueError: ``tokens``, ``rows_per_update``, ``buckets`` or ``trim`` out of range.
    """

    tokens: int | Literal["auto"]
    cost: Callable[[Any], Any] = dataclasses.field(kw_only=True)
    padded: bool = dataclasses.field(kw_only=True)
    items: Callable[[Any], Any] | None = dataclasses.field(default=None, kw_only=True)
    sort: bool = dataclasses.field(default=False, kw_only=True)
    rows_per_update: int | None = dataclasses.field(default=None, kw_only=True)
    buckets: Literal["pow2"] | Sequence[int] | None = dataclasses.field(
        default="pow2", kw_only=True
    )
    trim: Sequence[str | int] | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.tokens != "auto" and not positive_int(self.tokens):
            raise ValueError(
                f"TokenBudget: tokens={self.tokens!r} is not an int >= 1 or 'auto'; expected the "
                "cost of one micro-batch (e.g. 8192 tokens). Pass an int, or 'auto'."
            )
        for name, fn, also in (("cost", self.cost, ""), ("items", self.items, " or None")):
            if not callable(fn) and not (also and fn is None):
                raise TypeError(
                    f"TokenBudget: {name}={fn!r} is not callable{also}; expected {name}(batch) "
                    f"-> one int per row. Pass e.g. {name}=lambda batch: batch['lengths']."
                )
        for name, flag in (("padded", self.padded), ("sort", self.sort)):
            if not isinstance(flag, bool):
                raise TypeError(
                    f"TokenBudget: {name}={flag!r} is not a bool; expected True or False "
                    "(padded: a micro-batch costs rows x its longest row; False: their sum)."
                )
        if self.rows_per_update is not None and not positive_int(self.rows_per_update):
            raise ValueError(
                f"TokenBudget: rows_per_update={self.rows_per_update!r} is not an int >= 1 or "
                "None; expected the rows of one update over all ranks. Pass e.g. 256."
            )
        buckets = self.buckets
        if buckets is not None and buckets != "pow2":
            sizes = tuple(buckets) if isinstance(buckets, Sequence) else ()
            if isinstance(buckets, str) or not sizes or not all(map(positive_int, sizes)):
                raise ValueError(
                    f"TokenBudget: buckets={buckets!r}; expected 'pow2', None, or a sequence of "
                    "padded lengths (ints >= 1). Pass e.g. buckets=(64, 128, 256, 512)."
                )
            object.__setattr__(self, "buckets", tuple(sorted(set(sizes))))
        trim = self.trim
        if trim is not None:
            names = tuple(trim) if isinstance(trim, Sequence) and not isinstance(trim, str) else ()
            if not names or not all(isinstance(t, str | int) for t in names) or not self.padded:
                raise ValueError(
                    f"TokenBudget: trim={trim!r} (padded={self.padded}); expected a sequence of "
                    "leaf names with padded=True, e.g. trim=('input_ids', 'labels'). Fix it."
                )
            object.__setattr__(self, "trim", names)


def read_counts(values: Any, rows: int, name: str) -> list[int]:
    """``values`` (what ``TokenBudget.cost`` or ``.items`` gave) as one int >= 0 per row, read
    once (a tensor off the host is one sync). TypeError / ValueError naming ``name``."""
    if isinstance(values, Tensor):
        shape = tuple(values.shape)
        ints = not (values.is_floating_point() or values.is_complex())
        counts = values.tolist() if values.dim() == 1 and ints else []
    elif isinstance(values, Sequence) and not isinstance(values, str):
        shape, counts = (len(values),), list(values)
        ints = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in counts)
    else:
        raise TypeError(
            f"MicroBatchRunner: TokenBudget {name}(batch) gave a {type(values).__qualname__}; "
            "expected a 1-D integer tensor or a sequence of ints, one per row. Return e.g. "
            "batch['lengths']."
        )
    if shape != (rows,) or not ints or (counts and min(counts) < 0):
        raise ValueError(
            f"MicroBatchRunner: TokenBudget {name}(batch) gave {reprlib.repr(values)} (shape "
            f"{shape}); expected one int >= 0 per row of the batch ({rows} rows). Return "
            "integer counts, e.g. mask.sum(1), not a float or 2-D tensor."
        )
    return [int(v) for v in counts]


def padded_length(longest: int, buckets: Buckets, cap: int | None) -> int:
    """The length a micro-batch whose longest row costs ``longest`` is padded to: rounded up
    to a bucket, at most ``cap`` (the batch's padded length; None: no cap).

    >>> padded_length(37, "pow2", None), padded_length(37, "pow2", 40), padded_length(37, None, 40)
    (64, 40, 37)
    """
    if buckets is None:
        size = longest
    elif buckets == "pow2":
        size = 1 << (max(longest, 1) - 1).bit_length()
    else:
        size = next((b for b in buckets if b >= longest), cap or longest)
    return size if cap is None else min(size, cap)


class Cut(NamedTuple):
    """One micro-batch: its rows of the batch (a ``range`` when contiguous), its padded
    length (None when not padded) and its cost."""

    rows: Sequence[int]
    length: int | None
    cost: int


@dataclasses.dataclass
class RankRows:
    """One rank's rows: their costs (>= 1 each), the batch's padded length ``cap`` and the
    cost rules (``padded``, ``buckets``)."""

    costs: list[int]
    cap: int | None
    padded: bool
    buckets: Buckets

    def cut(self, rows: Sequence[int]) -> Cut:
        """``rows`` as one micro-batch."""
        costs = [self.costs[i] for i in rows]
        if not self.padded:
            return Cut(rows, None, sum(costs))
        length = self.length(max(costs))
        return Cut(rows, length, len(costs) * length)

    def greedy(self, order: Sequence[int], budget: int) -> list[Cut]:
        """``order``'s rows cut in turn, each micro-batch as many rows as fit ``budget``."""
        cuts: list[Cut] = []
        start, n = 0, len(order)
        while start < n:
            stop, longest, total = start, 0, 0
            while stop < n:
                c = self.costs[order[stop]]
                top, more = max(longest, c), total + c
                cost = (stop + 1 - start) * self.length(top) if self.padded else more
                if cost > budget and stop > start:
                    break
                longest, total, stop = top, more, stop + 1
            take = stop - start
            if self.buckets is not None:
                take = 1 << (take.bit_length() - 1)
            cuts.append(self.cut(order[start : start + take]))
            start += take
        return cuts

    def length(self, longest: int) -> int:
        """The padded length of a micro-batch whose longest row costs ``longest``."""
        return padded_length(longest, self.buckets, self.cap)


def even(plans: list[list[Cut]], ranks: list[RankRows]) -> None:
    """Give every rank's plan (in place) as many micro-batches as the longest one, halving
    the costliest micro-batch of more than one row until it has (rows: no fewer than that)."""
    parts = max(map(len, plans))
    for plan, rank in zip(plans, ranks):
        while len(plan) < parts:
            k = max((k for k, c in enumerate(plan) if len(c.rows) > 1), key=lambda k: plan[k].cost)
            rows = plan[k].rows
            half = (len(rows) + 1) // 2
            plan[k : k + 1] = [rank.cut(rows[:half]), rank.cut(rows[half:])]


def window_end(weights: Sequence[float], start: int, needed: float) -> tuple[int, bool]:
    """Where a window opening at row ``start`` ends: after the row at which ``weights`` summed
    from ``start`` reach ``needed`` (True: it ends there), else after the last row (False).

    >>> window_end([1, 1, 1, 1, 1], 0, 2), window_end([1, 1, 1, 1, 1], 4, 2)
    ((2, True), (5, False))
    """
    total = 0.0
    for row in range(start, len(weights)):
        total += weights[row]
        if total >= needed:
            return row + 1, True
    return len(weights), False


class Plan:
    """One call's micro-batches, window by window, for every rank at once (each rank plans
    them all alike from the same counts, so all agree without a collective).

    :meth:`ready` opens the next window (asking ``ends`` where it ends) once one is done;
    :meth:`next` gives every rank's next micro-batch under a budget and :meth:`advance`
    records that they ran; a new budget plans the rest of the window again. ``last``: a
    window that ends keeps its last row last when sorted (a window in items)."""

    def __init__(self, ranks: list[RankRows], ends: Ends, sort: bool, last: bool) -> None:
        self.ranks, self._ends, self._sort, self._last = ranks, ends, sort, last
        self._start, self._rows = 0, len(ranks[0].costs)
        self._orders: list[Sequence[int]] = []
        self._at: list[int] = []
        self._closing = False
        self._budget: int | None = None
        self._pending: list[list[Cut]] = []
        self._tails: list[tuple[list[int], list[int]]] = []  # per rank: longest, sum of [k:]

    def ready(self) -> bool:
        """Whether rows are left to run (opening the next window if the last one is done)."""
        if self._orders and self._at[0] < len(self._orders[0]):
            return True
        if self._start == self._rows:
            return False
        stop, self._closing = self._ends(self._start)
        rows, self._start = range(self._start, stop), stop
        kept = rows[len(rows) - 1 :] if self._closing and self._last else rows[:0]
        head = rows[: len(rows) - len(kept)]
        self._orders = [
            [*sorted(head, key=r.costs.__getitem__, reverse=True), *kept] if self._sort else rows
            for r in self.ranks
        ]
        self._at, self._pending, self._tails = [0] * len(self.ranks), [], []
        for rank, order in zip(self.ranks, self._orders):
            longest, total = [0] * (len(order) + 1), [0] * (len(order) + 1)
            for k in range(len(order) - 1, -1, -1):
                c = rank.costs[order[k]]
                longest[k], total[k] = max(longest[k + 1], c), total[k + 1] + c
            self._tails.append((longest, total))
        return True

    def next(self, budget: int) -> list[Cut]:
        """Every rank's next micro-batch under ``budget`` (after :meth:`ready` said True)."""
        if budget != self._budget or not self._pending:
            plans = [
                rank.greedy(order[at:], budget)
                for rank, order, at in zip(self.ranks, self._orders, self._at)
            ]
            if len(plans) > 1:
                even(plans, self.ranks)
            self._pending, self._budget = plans, budget
        return [plan[0] for plan in self._pending]

    @property
    def closes(self) -> bool:
        """Whether the micro-batches :meth:`next` gave last end a window that ends here."""
        return self._closing and len(self._pending[0]) == 1

    def advance(self) -> None:
        """The micro-batches :meth:`next` gave last ran."""
        for k, plan in enumerate(self._pending):
            self._at[k] += len(plan.pop(0).rows)

    def available(self) -> int:
        """What the rest of the window costs as one micro-batch (on the costliest rank)."""
        costs = []
        for rank, order, at, (longest, total) in zip(
            self.ranks, self._orders, self._at, self._tails
        ):
            left = len(order) - at
            costs.append(left * rank.length(longest[at]) if rank.padded else total[at])
        return max(costs)


def plan(
    spec: TokenBudget, ranks: list[tuple[list[int], int | None]], ends: Ends, last: bool = False
) -> Plan:
    """The :class:`Plan` of ``spec`` for every rank's ``(costs, padded length)``, its windows
    ending where ``ends`` says (``last``: windows in items, see :class:`Plan`).

    >>> def shapes(sort):
    ...     spec = TokenBudget(16, cost=len, padded=True, sort=sort, buckets=None)
    ...     p, out = plan(spec, [([3, 9, 2, 8, 4], None)], lambda start: (5, False)), []
    ...     while p.ready():
    ...         out.append((list(p.next(16)[0].rows), p.next(16)[0].length))
    ...         p.advance()
    ...     return out
    >>> shapes(sort=False)
    [([0], 3), ([1], 9), ([2, 3], 8), ([4], 4)]
    >>> shapes(sort=True)
    [([1], 9), ([3, 4], 8), ([0, 2], 3)]
    """
    buckets: Buckets = spec.buckets  # type: ignore[assignment]  # a tuple after __post_init__
    rows = [RankRows([max(1, c) for c in costs], cap, spec.padded, buckets) for costs, cap in ranks]
    return Plan(rows, ends, spec.sort, last)


def unpadded_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A shape key (``_tree.RowSlicer.shape_key``) with every leaf's dim 1 left out: the
    ``"auto"`` budget's ceiling is per key, whatever length a batch is padded to."""
    return tuple((path, ("*", *shape[1:]) if shape else shape, dtype) for path, shape, dtype in key)


def padded_leaves(
    leaves: list[tuple[str, Any, str]], longest: int, trim: Sequence[str | int] | None = None
) -> tuple[int | None, list[int]]:
    """``padded=True``: the batch's padded length ``P`` and the numbers of the leaves a
    micro-batch cuts to its padded length along dim 1: those ``trim`` names (key, attribute or
    index; ``P`` their dim 1), or, without ``trim``, every dense leaf of 2+ dims whose dim 1 is
    the largest (``P``; None if there is none). ValueError if a row costs more than ``P``,
    if ``trim`` names no such leaf or leaves of two lengths, or (without ``trim``) if a leaf
    as long as the longest row but shorter than ``P`` leaves it unclear which are padded."""
    found = [
        (k, path, leaf.size(1))
        for k, (path, leaf, how) in enumerate(leaves)
        if how == "slice" and leaf.dim() >= 2
    ]
    if trim is not None:
        found = [f for f in found if any(_names(f[1], name) for name in trim)]
        if not found or len({size for _, _, size in found}) > 1:
            shapes = ", ".join(f"{path} of {size}" for _, path, size in found) or "none"
            raise ValueError(
                f"MicroBatchRunner: TokenBudget(trim={tuple(trim)!r}) picks dense leaves of 2+ "
                f"dims with dim 1 {shapes}; expected one or more, all as long. Name the leaves "
                "padded along dim 1."
            )
    elif not found:
        return None, []
    length = max(size for _, _, size in found)
    if longest > length:
        path = next(p for _, p, size in found if size == length)
        raise ValueError(
            f"MicroBatchRunner: a row costs {longest}, more than the batch's padded length "
            f"{length} ({path}.size(1)); expected padded=True costs to be row lengths along "
            "dim 1. Return lengths from cost(batch), or use padded=False."
        )
    unclear = [(p, size) for _, p, size in found if longest <= size < length]
    if unclear:
        path, size = unclear[0]
        raise ValueError(
            f"MicroBatchRunner: {path} has dim 1 of {size}, as long as the longest row "
            f"({longest}) but shorter than the padded length {length}, so which leaves are "
            "padded is unclear; expected one padded length. Name them: TokenBudget(trim=(...))."
        )
    return length, [k for k, _, size in found if size == length]


def _names(path: str, name: str | int) -> bool:
    """Whether the leaf at ``path`` is the batch's own ``name`` (``batch['ids']``, ``batch.ids``,
    ``batch[0]``), not a leaf of that name nested deeper."""
    if isinstance(name, int):
        return path == f"batch[{name}]"
    return path in (f"batch[{name!r}]", f"batch.{name}")


def check_padding(
    leaves: list[tuple[str, Any, str]], trim: list[int], costs: list[int], length: int
) -> None:
    """ValueError unless every host leaf numbered ``trim`` holds one value (its padding) at every
    position past its row's cost along dim 1, up to ``length``: a cost shorter than the row
    (its loss-bearing tokens, say) would have the cut drop real tokens, and a per-row feature as
    wide as ``length`` is no padded leaf. Leaves on an accelerator are not read (a sync)."""
    past = torch.arange(length)[None, :] >= torch.tensor(costs)[:, None]
    if not bool(past.any()):
        return
    for k in trim:
        path, leaf, _ = leaves[k]
        if leaf.device.type != "cpu":
            continue
        pads = leaf[past]  # a padded leaf's dim 1 is ``length``
        same = pads == pads[0]
        if pads.is_floating_point() or pads.is_complex():
            same |= pads.isnan() & pads[0].isnan()
        if not bool(same.all()):
            raise ValueError(
                f"MicroBatchRunner: {path} holds other values than one padding value past some "
                "row's cost along dim 1; expected padded=True costs to be each row's full length "
                "(all past it padding). Return the lengths from cost(batch), or name the padded "
                "leaves with TokenBudget(trim=...)."
            )


@dataclasses.dataclass
class Tally:
    """What a budget runner ran so far (``runner.tally``).

    Attributes:
        micro_batches, rows: micro-batches and rows that ran (this rank's).
        tokens: their cost (the rows' own costs summed, each at least 1).
        computed: what they were run at: rows x padded length summed (``padded``), else
            ``tokens``.
        failed: attempts that ran out of memory; wasted: what they were run at, summed.
        shapes: every ``(rows, padded length)`` run (the length None when not padded).
    """

    micro_batches: int = 0
    rows: int = 0
    tokens: int = 0
    computed: int = 0
    failed: int = 0
    wasted: int = 0
    shapes: set[tuple[int, int | None]] = dataclasses.field(default_factory=set)

    @property
    def padding(self) -> float:
        """The share of ``computed`` that was padding (0.0 before anything ran)."""
        return 1.0 - self.tokens / self.computed if self.computed else 0.0

    def ran(self, cut: Cut, costs: list[int]) -> None:
        """Count ``cut`` (rows' costs in ``costs``) as run."""
        self.micro_batches, self.rows = self.micro_batches + 1, self.rows + len(cut.rows)
        self.tokens += sum(costs[i] for i in cut.rows)
        self.computed += cut.cost
        self.shapes.add((len(cut.rows), cut.length))

    def lost(self, cut: Cut) -> None:
        """Count ``cut`` as an attempt that ran out of memory."""
        self.failed, self.wasted = self.failed + 1, self.wasted + cut.cost

"""Feed one large batch to an ``Accumulate`` wrapper as micro-batches weighed by their items;
with ``"auto"``, find the largest one that fits from OOM errors, losing or repeating no sample."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeAlias, cast

import torch
from torch import Tensor, nn

from accumopt import _tree, split
from accumopt._checks import check_count, check_count_tensor, positive_int
from accumopt.accumulate import Accumulate
from accumopt.autosize import MicroBatchSizer, NoMicroBatchFits, check_search, describe_key, logger
from accumopt.batchnorm import warn_small_batchnorm
from accumopt.budget import (
    Tally,
    TokenBudget,
    check_padding,
    padded_leaves,
    plan,
    read_counts,
    unpadded_key,
    window_end,
)
from accumopt.oom import free_memory, is_oom, memory_report

Scaler: TypeAlias = "torch.amp.GradScaler | None"

NOT_TRAINED = (
    "The micro-batches before this one were trained; this one and the rest of the batch were not."
)


class MicroBatchRunner:
    """Forward and backward a large batch in micro-batches, feeding an ``Accumulate`` wrapper.

    Each call processes every row once, in order, the wrapper's ``scaler`` (if any) scaling
    and stepping; a micro-batch is cut where the window in items fills (``every_items=N``: N
    rows per update over all ranks). ``"auto"`` and its rollback: docs/guide/one-big-batch.md.
    With ``budget=``, micro-batches are cut by their cost (tokens) instead of their rows
    (:class:`accumopt.TokenBudget`).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=32)
        >>> def loss_fn(batch):  # the micro-batch's mean loss, as torch's losses return it
        ...     return torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        >>> runner = MicroBatchRunner(opt, loss_fn, loss_reduction="mean", model=model)  # "auto"
        >>> mean_loss = runner((torch.randn(32, 4), torch.randn(32, 1)))  # one update
        >>> opt.updates, runner.ooms
        (1, 0)

    Args:
        optimizer: the ``Accumulate`` wrapper to feed.
        loss_fn: called with each micro-batch (nested as the batch, tensors on ``device``);
            returns its loss (a one-element tensor that requires grad), ``(loss, items)``
            (the items it covers, e.g. tokens, a number >= 0 or one-element tensor; default:
            the rows) or ``(loss, items, outputs)``. The runner runs the backward pass.
        micro_batch_size: rows per micro-batch (int >= 1), or ``"auto"`` (None, the default:
            ``"auto"``, or the budget's cuts with ``budget=``).
        budget: a :class:`accumopt.TokenBudget`: micro-batches cut by a budget on their cost
            (tokens), their items counted on the host; the wrapper's window must be in items
            (``every_items=T``, or ``math.inf`` with ``rows_per_update``). ``loss_fn`` then
            returns its loss alone (or ``(loss, None, outputs)``).
        device: where micro-batches run (None: where they are), copied without blocking.
        loss_reduction: required: ``"mean"`` (``loss`` is the mean over its items) or ``"sum"``.
        model: the module ``loss_fn`` runs: its buffers are restored after a failed attempt
            (default: the wrapper's), and small micro-batches through its BatchNorm warn once.
        start_size, tolerance, grow_after, max_size: the ``"auto"`` search
            (:class:`accumopt.autosize.MicroBatchSizer`; ``start_size=None``: the batch; in
            the budget's unit with ``budget=``).

    Attributes:
        sizer: the ``"auto"`` search (None before it starts, or with a fixed size).
        budget: the ``TokenBudget``, or None. tally: with ``budget=``, what ran
            (:class:`accumopt.budget.Tally`: padding, failed attempts and the cost they
            wasted, the shapes run); else None.

    Raises:
        TypeError: ``optimizer`` is not an ``Accumulate``; ``budget`` not a ``TokenBudget``.
        ValueError: a setting out of range; ``"auto"`` or ``budget=`` over
            ``Accumulate(every=k)``; ``budget=`` with ``micro_batch_size``;
            ``rows_per_update`` without ``every_items=math.inf``.
        RuntimeError: ``"auto"`` with a wrapper that cannot roll back (``buffer=False``, FSDP2).
    """

    def __init__(
        self,
        optimizer: Accumulate,
        loss_fn: Callable[[Any], Any],
        *,
        micro_batch_size: int | Literal["auto"] | None = None,
        budget: TokenBudget | None = None,
        device: torch.device | str | None = None,
        loss_reduction: Literal["mean", "sum"] | None = None,
        model: nn.Module | None = None,
        start_size: int | None = None,
        tolerance: float = 0.02,
        grow_after: int | None = 1000,
        max_size: int | None = None,
    ) -> None:
        if not isinstance(optimizer, Accumulate):
            raise TypeError(
                f"MicroBatchRunner: optimizer is a {type(optimizer).__qualname__}; expected an "
                "accumopt.Accumulate wrapper (Accumulate(torch.optim.AdamW(...), every_items=N))."
            )
        size: Any = "auto" if micro_batch_size is None else micro_batch_size
        if budget is not None:
            _check_budget(optimizer, micro_batch_size, budget)
            size = budget.tokens
        auto = size == "auto"
        if auto and optimizer.every is not None:
            raise ValueError(
                f"MicroBatchRunner: micro_batch_size='auto' with every={optimizer.every}; expected "
                "Accumulate(..., every_items=N) (fixed rows per update), or a fixed size."
            )
        if not auto and not positive_int(size):
            raise ValueError(
                f"MicroBatchRunner: micro_batch_size={size!r}; expected an int >= 1 or 'auto'."
            )
        if loss_reduction not in ("mean", "sum"):
            error = TypeError if loss_reduction is None else ValueError
            given = " is required" if loss_reduction is None else f"={loss_reduction!r} is unknown"
            raise error(
                f"MicroBatchRunner: loss_reduction{given}; expected 'mean' (loss_fn returns the "
                "micro-batch's mean loss, torch's default) or 'sum' (its summed loss, 0.1's)."
            )
        check_search("MicroBatchRunner", "start_size", start_size, tolerance, grow_after, max_size)
        self.optimizer, self.loss_fn, self.model = optimizer, loss_fn, model
        where = f"MicroBatchRunner: device={device!r}"
        self.device = None if device is None else split.parse_device(device, where)
        if not callable(loss_fn):
            raise TypeError(
                f"MicroBatchRunner: loss_fn={loss_fn!r} is not callable; expected a function "
                "of a micro-batch returning its loss (see loss_reduction)."
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"MicroBatchRunner: model is a {type(model).__qualname__}; expected the "
                "torch.nn.Module loss_fn runs (its buffers and RNG are restored after an OOM)."
            )
        self.loss_reduction = loss_reduction
        self._fixed = None if auto else int(size)
        self._start, self._search = start_size, (tolerance, grow_after, max_size)
        self.sizer: MicroBatchSizer | None = None
        self.budget, self.tally = budget, None if budget is None else Tally()
        self._window_rows = 0  # rows_per_update: the rows of the runner's open window
        self._mark: tuple[int, int, Any] = (0, 0, 0.0)  # and the window it left
        if auto:
            optimizer.enable_rollback()  # a failed micro-batch must be droppable alone

    @property
    def micro_batch_size(self) -> int | None:
        """The fixed size, or where the ``"auto"`` search stands (None before the first call),
        in rows (with ``budget=``: in the budget's unit)."""
        return self._fixed if self.sizer is None else self.sizer.current

    @property
    def ooms(self) -> int:
        """Out-of-memory errors recovered from so far."""
        return 0 if self.sizer is None else self.sizer.ooms

    @property
    def history(self) -> list[tuple[str, int, str]]:
        """Every size change as (inputs, new size, reason), the inputs (one ceiling each) as
        ``"batch[0]: (3, 32, 32) float32, batch[1]: () int64"`` (shapes past dim 0)."""
        changes = [] if self.sizer is None else self.sizer.history
        return [(describe_key(key), size, why) for key, size, why in changes]

    def __call__(self, batch: Any, *, return_outputs: bool = False) -> Any:
        """Process every row of ``batch`` (a tensor or nesting of tensors sharing dim 0, any
        device; other leaves go to every micro-batch) once; return the mean loss over its items
        (detached, of the losses' shape and device), or ``(mean, outputs)`` with
        ``return_outputs`` (the outputs of ``loss_fn`` concatenated).

        Raises:
            RuntimeError: the wrapper refuses (``opt.discard()``), or its window waits for
                ``step()``; with ``rows_per_update``, micro-steps the runner did not run are
                in the window. NoMicroBatchFits: with ``"auto"``, one row ran out of memory.
            TypeError, ValueError: an empty or ragged batch; a ``loss_fn`` result that
                cannot be counted or joined (the micro-batches before it were trained); with
                ``budget=``, bad counts from ``cost``/``items``, costs longer than the padded
                length, items from ``loss_fn``, rows that differ between ranks.
            Others propagate; with ``"auto"`` the buffers and generators are restored.
        """
        if not isinstance(return_outputs, bool):
            raise TypeError(
                f"MicroBatchRunner: return_outputs={return_outputs!r} is a "
                f"{type(return_outputs).__qualname__}; expected True or False."
            )
        opt = self.optimizer
        opt.check_usable("MicroBatchRunner")
        if opt.will_update:
            raise RuntimeError(
                "MicroBatchRunner: the wrapper's window is complete and waits for step(); "
                "expected opt.step() first. Nothing of this batch was run."
            )
        rows_of = _tree.RowSlicer(batch, self.device)
        scaler = opt.scaler if opt.scaler is not None and opt.scaler.is_enabled() else None
        totals = _Totals(return_outputs, self.loss_reduction == "mean")
        if self.budget is not None:
            if return_outputs and self.budget.sort:
                raise ValueError(
                    "MicroBatchRunner: return_outputs=True with TokenBudget(sort=True), whose "
                    "outputs come in the order the rows ran; expected sort=False to get them in "
                    "the batch's order. Nothing of this batch was run."
                )
            self._run_budget(batch, rows_of, scaler, totals)
            return totals.result()
        if self._fixed is None:
            self._run_auto(rows_of, scaler, totals)
        else:
            for piece, rows in _pieces(rows_of, self._fixed, opt):
                warn_small_batchnorm(self.model, rows)
                totals.add(*self._forward_backward(piece, rows, totals, scaler, False), rows)
                self._step(scaler)
        return totals.result()

    def _run_auto(self, rows_of: _tree.RowSlicer, scaler: Scaler, totals: _Totals) -> None:
        """The ``"auto"`` loop; a window opened at a proven size runs without rollback."""
        opt = self.optimizer
        n, ranks = rows_of.rows, opt.world_size > 1  # read now: set_model() may follow init
        if ranks:
            _same_rows(opt, n, "micro_batch_size='auto'")
        if self.sizer is None:
            self.sizer = MicroBatchSizer(self._start or n, *self._search)
        sizer, key = self.sizer, rows_of.shape_key()
        opened = None  # restores the window opened without rollback to its start
        may_open = not ranks and scaler is None  # ranks agree on each micro-batch: buffer it
        while (offset := totals.rows) < n:
            size = sizer.propose(key, _room(opt, n - offset))
            warn_small_batchnorm(self.model, size)
            proven = sizer.proven(key, size)
            if opened is not None and not proven:  # a larger size is probed: roll back alone
                opened = None
            elif opened is None and proven and may_open and opt.disable_rollback():
                opened = self._snapshot(totals)
            if opened is None and not opt.rollback:
                opt.enable_rollback()
            piece = functools.partial(rows_of, offset, offset + size)
            result = self._attempt(piece, size, totals, scaler, ranks, opened)
            if not isinstance(result, str):
                sizer.succeeded(key, size)
                self._step(scaler)
                totals.add(*result, size)
                if opened is not None and opt.micro_step == 0:  # the window was applied
                    opened = None
                continue
            opened = None
            if totals.rows < offset:  # the window starts again from its first row
                logger.info("window restarted at row %d, failed at row %d", totals.rows, offset)
            self._back_off(key, size, result)

    def _run_budget(
        self, batch: Any, rows_of: _tree.RowSlicer, scaler: Scaler, totals: _Totals
    ) -> None:
        """The loop of ``budget=``: every row once, window by window (docs: "One big batch",
        "Micro-batches cut by a token budget")."""
        opt, spec = self.optimizer, cast(TokenBudget, self.budget)
        n, rank, world = rows_of.rows, opt.rank, opt.world_size
        if world > 1:
            _same_rows(opt, n, "budget=")
        per = None if spec.rows_per_update is None else _per_rank(opt, spec.rows_per_update)
        if (
            per is not None
            and opt.micro_step
            and self._mark != (opt.updates, opt.micro_step, opt.items)
        ):
            raise RuntimeError(
                f"MicroBatchRunner: the wrapper's window holds {opt.micro_step} micro-step(s) "
                "the runner did not run, so the rows of its window are unknown; expected "
                "rows_per_update's windows fed by the runner alone. Call opt.flush() or "
                "opt.discard() first."
            )
        problem: Exception | None = None
        try:
            costs = read_counts(spec.cost(batch), n, "cost")
            items = n * [1] if spec.items is None else read_counts(spec.items(batch), n, "items")
            cap, trim = (
                padded_leaves(rows_of.leaves, max(costs), spec.trim) if spec.padded else (None, [])
            )
            if trim:
                check_padding(rows_of.leaves, trim, costs, cast(int, cap))
        except (TypeError, ValueError) as err:  # refused on every rank, after the collective
            problem, costs, items, cap, trim = err, n * [1], n * [1], None, []
        table = _gather(opt, [float(problem is not None), float(cap or 0), *costs, *items])
        if problem is not None:
            raise problem
        if any(row[0] for row in table):
            raise ValueError(
                "MicroBatchRunner: another rank refused its TokenBudget counts (its error says "
                "why); expected valid counts on every rank. Nothing of this batch was run."
            )
        table = [row[1:] for row in table]  # every rank's padded length and counts
        if per is None:  # the items of each position over the ranks
            weights = [sum(row[1 + n + i] for row in table) for i in range(n)]
        else:  # the rows of each rank
            weights = n * [1.0]

        def ends(start: int) -> tuple[int, bool]:
            if per is not None:
                if not opt.micro_step:  # a window flushed or discarded since
                    self._window_rows = 0
                return window_end(weights, start, per - self._window_rows)
            return window_end(weights, start, cast(float, opt.every_items) - opt.items)

        counts = [([int(c) for c in row[1 : 1 + n]], int(row[0]) or None) for row in table]
        cuts_of = plan(spec, counts, ends, last=per is None)
        tally, key = cast(Tally, self.tally), unpadded_key(rows_of.shape_key())
        cuts_of.ready()  # the first window opens (a batch has rows)
        if self._fixed is None and self.sizer is None:  # it starts the search, whole
            self.sizer = MicroBatchSizer(self._start or cuts_of.available(), *self._search)
        sizer = self.sizer if self._fixed is None else None
        while cuts_of.ready():
            size = self._fixed or cast(MicroBatchSizer, sizer).propose(key, cuts_of.available())
            cuts = cuts_of.next(size)
            mine, cost = cuts[rank], max(cut.cost for cut in cuts)
            warn_small_batchnorm(self.model, len(mine.rows))
            piece = functools.partial(rows_of.take, mine.rows, mine.length or 0, trim)
            weight = sum(items[i] for i in mine.rows)
            if sizer is None:
                result = self._forward_backward(piece(), weight, totals, scaler, False)
            elif isinstance(
                got := self._attempt(piece, weight, totals, scaler, world > 1, None), str
            ):
                tally.lost(mine)
                self._back_off(key, 1 if max(len(c.rows) for c in cuts) == 1 else cost, got)
                continue
            else:
                result = got
                sizer.succeeded(key, min(cost, size))
            tally.ran(mine, cuts_of.ranks[rank].costs)
            self._step(scaler)
            totals.add(*result, len(mine.rows))
            closes = cuts_of.closes
            cuts_of.advance()
            if per is not None:
                self._window_rows += len(mine.rows)
                if closes:
                    opt.flush()
                    self._window_rows = 0
                self._mark = opt.updates, opt.micro_step, opt.items

    def _attempt(
        self,
        piece: Callable[[], Any],
        rows: int,
        totals: _Totals,
        scaler: Scaler,
        ranks: bool,
        opened: Callable[[], None] | None,
    ) -> tuple[Tensor, Tensor | None, float, Any] | str:
        """Run ``piece()`` (of ``rows`` default items) as a micro-step that may run out of
        memory: :meth:`_forward_backward`'s result, or the error (a str) with the micro-step (or
        the window ``opened`` without rollback) dropped and ``totals``, the buffers and the
        generators restored, memory freed; the ranks agree. Other errors propagate, restored
        alike."""
        opt = self.optimizer
        restore = self._snapshot(totals) if opened is None else opened
        failure, result = None, None
        try:
            result = self._forward_backward(piece(), rows, totals, scaler, ranks)
        except BaseException as err:
            if not is_oom(err):
                if opened is not None:  # drop the window run without rollback
                    opt.discard()
                restore()
                raise
            failure = f"{type(err).__name__}: {err}"
        if ranks:  # all ranks back off together, or none does
            what = "a micro-batch's out-of-memory failure"
            failed = opt.sum_over_ranks(float(failure is not None), 0.0, what)[0]
            if failed and failure is None:
                failure = f"out of memory on {failed:g} other rank(s)"
            if failure is None:
                opt.commit()
        if failure is None:
            assert result is not None
            return result
        result = None  # outside the except block: the traceback is gone
        if opened is not None:
            opt.discard()
        else:
            opt.drop_micro_step()
        restore()
        free_memory()
        return failure

    def _back_off(self, key: Any, size: int, failure: str) -> None:
        """Record an out-of-memory error at ``size`` for ``key``; NoMicroBatchFits at 1."""
        try:
            cast(MicroBatchSizer, self.sizer).failed(key, size)
        except NoMicroBatchFits as err:
            raise NoMicroBatchFits(
                f"{err} Memory: {memory_report(self.device)}. Last error: {failure[:400]}"
            ) from None

    def _forward_backward(
        self, piece: Any, rows: int, totals: _Totals, scaler: Scaler, hold: bool
    ) -> tuple[Tensor, Tensor | None, float, Any]:
        """``loss_fn`` and backward on ``piece``: (loss, seed of a mean's pass, items, out)."""
        opt = self.optimizer
        loss, items, out = _parse(self.loss_fn(piece), rows, self.budget is not None)
        if totals.keep:  # before the backward pass: a micro-batch refused here is not counted
            _joined(out, totals.reference)
        if totals.mean and items == 0:  # 0/0 has a NaN gradient: backpropagate an exact zero
            groups = opt.param_groups if opt.world_size > 1 else []  # DDP waits for every grad
            sums = [p.sum() for g in groups for p in g["params"] if p.requires_grad]
            loss = sum(sums, loss.new_zeros((), requires_grad=True)) * 0.0  # else .grad None
        scaled = loss if scaler is None else scaler.scale(loss)
        seed = torch.full_like(scaled, items) if totals.mean else None  # mean -> summed loss
        opt.backward(scaled, items, hold=hold, gradient=seed)
        return loss.detach(), seed, items, out  # not the graph: a ctx or hook may hold memory

    def _step(self, scaler: Scaler) -> None:
        opt = self.optimizer
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()

    def _snapshot(self, totals: _Totals) -> Callable[[], None]:
        """Save ``totals``, the buffers and the CPU and CUDA generators; return what restores."""
        t = totals
        mark = len(t.losses), t.items, t.rows, len(t.outputs), t.reference
        model = self.model if self.model is not None else self.optimizer.model
        named = list(model.named_buffers()) if model is not None else []
        saved = [(name, buf, buf.detach().clone()) for name, buf in named]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]

        def restore() -> None:
            losses, t.items, t.rows, outputs, t.reference = mark
            del t.losses[losses:], t.seeds[losses:], t.outputs[outputs:], t.sizes[outputs:]
            current = dict(model.named_buffers()) if model is not None else {}
            with torch.no_grad():
                for name, buf, copy in saved:
                    buf.copy_(copy)
                    if current.get(name) is not buf:  # reassigned (self.x = new) or deleted
                        owner, _, attr = name.rpartition(".")
                        setattr(model.get_submodule(owner), attr, buf)  # type: ignore[union-attr]
            torch.set_rng_state(cpu_rng)
            torch.cuda.set_rng_state_all(cuda_rng)

        return restore


def _check_budget(opt: Accumulate, micro_batch_size: object, spec: object) -> None:
    """Refuse a ``budget=`` the runner cannot honour with ``opt``."""
    if not isinstance(spec, TokenBudget):
        raise TypeError(
            f"MicroBatchRunner: budget={_tree.short(spec)} is a {type(spec).__qualname__}; "
            "expected an accumopt.TokenBudget. Pass budget=TokenBudget(8192, cost=..., padded=...)."
        )
    if micro_batch_size is not None:
        raise ValueError(
            f"MicroBatchRunner: micro_batch_size={micro_batch_size!r} with budget=; expected one "
            "of them (a budget cuts micro-batches by cost, not rows). Leave micro_batch_size out."
        )
    if opt.every is not None:
        raise ValueError(
            f"MicroBatchRunner: budget= with every={opt.every}; expected a window in items, "
            "Accumulate(..., every_items=T). Count the window in items (tokens), or in rows "
            "with every_items=math.inf and TokenBudget(rows_per_update=N)."
        )
    if spec.rows_per_update is not None and opt.every_items != math.inf:
        raise ValueError(
            f"MicroBatchRunner: TokenBudget(rows_per_update={spec.rows_per_update}) with "
            f"every_items={opt.every_items:g}; expected Accumulate(..., every_items=math.inf), "
            "whose windows the runner closes (opt.flush()). Build the wrapper that way."
        )


def _per_rank(opt: Accumulate, rows: int) -> int:
    """``rows_per_update`` rows of each window over all ranks, as rows of each rank."""
    if rows % opt.world_size:
        raise ValueError(
            f"MicroBatchRunner: TokenBudget(rows_per_update={rows}) over {opt.world_size} ranks; "
            "expected a multiple of the ranks (each runs as many rows). Pick another size."
        )
    return rows // int(opt.world_size)


def _same_rows(opt: Accumulate, rows: int, setting: str) -> None:
    """Refuse (on every rank) a batch whose rows differ between the ranks."""
    total, squares = opt.sum_over_ranks(rows, rows * rows, "the rows of the runner's batch")
    if squares * opt.world_size != total * total:  # equal on every rank
        raise ValueError(
            f"MicroBatchRunner: this rank's batch has {rows} rows, all ranks' {total:g}; "
            f"expected as many rows on every rank with {setting}."
        )


def _gather(opt: Accumulate, row: list[float]) -> list[list[float]]:
    """Every rank's ``row`` (as long on every rank), by one sum over the ranks (a sync)."""
    if opt.world_size == 1:
        return [row]
    device = opt.param_groups[0]["params"][0].device  # where the model's group reduces
    table = torch.zeros(opt.world_size, len(row), dtype=torch.float64, device=device)
    table[opt.rank] = torch.tensor(row, dtype=torch.float64)
    opt.all_reduce_([table])
    return cast(list[list[float]], table.tolist())


def _room(opt: Accumulate, rows: int) -> int:
    """Of ``rows``, those (>= 1) that fill the window in items at one item per row per rank."""
    if (size := opt.every_items) is None or size == math.inf:
        return rows
    return min(rows, max(1, math.ceil((size - float(opt.items)) / float(opt.world_size))))


def _pieces(rows_of: _tree.RowSlicer, size: int, opt: Accumulate) -> Iterator[tuple[Any, int]]:
    """``(piece, rows)`` of ``size`` rows in order, cut again where the window fills."""
    offset = 0
    for piece, rows in rows_of.split(size):
        cut = False
        while (fill := _room(opt, rows)) < rows:
            yield rows_of(offset, offset + fill), fill
            offset, rows, cut = offset + fill, rows - fill, True
        yield (rows_of(offset, offset + rows) if cut else piece), rows
        offset += rows


def _parse(result: Any, rows: int, counted: bool = False) -> tuple[Tensor, float, Any]:
    """``loss_fn``'s result as (loss, items, outputs), items left out as ``rows``, refusing what
    cannot be counted (an items tensor is read once: a sync); when the runner ``counted`` them
    on the host (``budget=``), the items must be None or left out: ``rows``."""
    items: float
    if isinstance(result, Tensor):
        loss, items, out = result, rows, None  # an int: the wrapper's quickest count
    elif isinstance(result, tuple) and len(result) in (2, 3):
        loss, n, out = result[0], result[1], (result[2] if len(result) == 3 else None)
        what, covers = "MicroBatchRunner: loss_fn returned items", "the micro-batch's loss"
        if counted and n is not None:
            raise ValueError(
                f"MicroBatchRunner: loss_fn returned items={_tree.short(n)} with budget=, which "
                "counts each micro-batch's items on the host; expected the loss alone, or (loss, "
                "None, outputs). Give the count as TokenBudget(items=...) (one per row by "
                f"default). {NOT_TRAINED}"
            )
        try:
            if counted:
                items = rows
            elif not isinstance(n, Tensor):
                items = check_count(n, what, covers, ", which")
            else:
                check_count_tensor(n, f"{what}={_tree.short(n)}, which")
                items = check_count(n.item(), what, covers, f" (read from {_tree.short(n)}), which")
        except ValueError as err:
            raise ValueError(
                f"{err} Return (loss, items), items a number or a one-element tensor (e.g. "
                f"mask.sum()). {NOT_TRAINED}"
            ) from None
    else:
        raise TypeError(
            f"MicroBatchRunner: loss_fn returned a {type(result).__qualname__}; expected a loss "
            f"tensor, (loss, items) or (loss, items, outputs). {NOT_TRAINED}"
        )
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"MicroBatchRunner: loss_fn returned loss={_tree.short(loss)}, a "
            f"{type(loss).__qualname__}; expected a one-element tensor that requires grad, not "
            f"loss.item(). {NOT_TRAINED}"
        )
    if loss.numel() != 1 or not loss.requires_grad:
        wrong = "that does not require grad (computed under torch.no_grad() or detached)"
        if loss.numel() != 1:
            wrong = f"of shape {tuple(loss.shape)}"
        raise ValueError(
            f"MicroBatchRunner: loss_fn returned loss={_tree.short(loss)}, a tensor {wrong}; "
            "expected a one-element tensor that requires grad (.mean(), or .sum() with "
            f"loss_reduction='sum'; autograd on). {NOT_TRAINED}"
        )
    return loss, items, out


def _joined(out: Any, reference: dict[str, Any] | None) -> dict[str, Any] | None:
    """Refuse an ``out`` that cannot join ``reference``; return what later outputs must join."""
    if out is None:
        return reference
    leaves = dict(_tree.flatten(out, "MicroBatchRunner", root="outputs")[0])
    if reference is not None and leaves.keys() != reference.keys():
        raise ValueError(
            "MicroBatchRunner: loss_fn returned outputs nested differently from the first "
            f"micro-batch's; expected one structure (return_outputs=True). {NOT_TRAINED}"
        )
    for path, leaf in leaves.items():
        was = leaf if reference is None else reference[path]
        if not (isinstance(was, Tensor) and was.dim() > 0):
            continue
        joinable = isinstance(leaf, Tensor) and leaf.dim() > 0
        if joinable and not (_empty(leaf) or _empty(was)):
            joinable = _tree.row_shape(leaf) == _tree.row_shape(was)
        if not joinable:
            what = f"of shape {tuple(leaf.shape)}" if isinstance(leaf, Tensor) else "no tensor"
            raise ValueError(
                f"MicroBatchRunner: loss_fn returned outputs with {path} {what}, which cannot "
                f"be concatenated along dim 0 with the earlier {tuple(was.shape)}; expected one "
                f"shape past dim 0 (pad, or return PerSample(list(...))). {NOT_TRAINED}"
            )
        try:
            _tree.check(path, leaf, "MicroBatchRunner")
        except TypeError as err:
            raise TypeError(f"{err} (return_outputs=True) {NOT_TRAINED}") from None
    if reference is None:
        return leaves
    return {
        path: leaves[path] if isinstance(was, Tensor) and _empty(was) else was
        for path, was in reference.items()
    }


def _empty(t: Tensor) -> bool:
    """``torch.empty(0)``, which ``torch.cat`` leaves out whatever the others' shapes."""
    return t.dim() == 1 and t.numel() == 0 and t.layout == torch.strided and not t.is_nested


class _Totals:
    """One batch's losses (a mean times its ``seed``, its items), items and outputs."""

    def __init__(self, keep: bool, mean: bool) -> None:
        self.keep, self.mean = keep, mean
        self.losses: list[Tensor] = []
        self.seeds: list[Tensor] = []
        self.items, self.rows = 0.0, 0
        self.outputs: list[Any] = []
        self.sizes: list[int] = []
        self.reference: dict[str, Any] | None = None  # what later outputs must join

    def add(self, loss: Tensor, seed: Tensor | None, items: float, out: Any, rows: int) -> None:
        self.losses.append(loss)
        if seed is not None:
            self.seeds.append(seed)
        self.items, self.rows = self.items + items, self.rows + rows
        if self.keep and out is not None:
            self.outputs.append(out)
            self.sizes.append(rows)
            self.reference = _joined(out, self.reference)

    def result(self) -> Any:
        losses, seeds = self.losses, self.seeds  # a batch has >= 1 row: >= 1 micro-batch
        if len(losses) > 1 and all(loss.shape == losses[0].shape for loss in losses):
            stacked = torch.stack(losses)  # a few dispatches per batch, not one per micro-batch
            total = (stacked * torch.stack(seeds) if self.mean else stacked).sum(0)
        else:  # one-element losses of other shapes ((), (1,), ...) broadcast
            summed = [a * b for a, b in zip(losses, seeds)] if self.mean else losses
            total = sum(summed[1:], summed[0])
        mean = total / self.items if self.items > 0 else torch.zeros_like(total)
        if not self.keep:
            return mean
        return mean, (_tree.concat(self.outputs, sizes=self.sizes) if self.outputs else None)

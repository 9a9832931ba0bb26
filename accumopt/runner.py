"""Run one large batch as micro-batches through an ``Accumulate`` wrapper, surviving OOM:
:class:`MicroBatchRunner` cuts the batch (which may stay in host memory) into micro-batches,
runs forward and backward per micro-batch with exact item weights and, with ``"auto"``, finds
the largest micro-batch that fits from out-of-memory errors, losing or repeating no sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor

from accumopt import _cuts, _tree
from accumopt._checks import positive_int
from accumopt._loss_result import check_outputs, parse, summed
from accumopt._module_state import ModuleState
from accumopt._totals import Opened, Totals
from accumopt.accumulate import AccumulatingOptimizer
from accumopt.autosize import MicroBatchSizer, NoMicroBatchFits, check_search, describe_key
from accumopt.batchnorm import warn_small_batchnorm
from accumopt.oom import free_memory, is_oom, memory_report

logger = logging.getLogger("accumopt")

Scaler: TypeAlias = "torch.amp.GradScaler | None"
"""The wrapper's ``GradScaler`` while it is enabled, else None (read once per batch)."""

LossFn = Callable[[Any], Any]
"""``loss_fn(micro_batch)`` returns ``loss``, ``(loss, items)`` or ``(loss, items, outputs)``."""


class MicroBatchRunner:
    """Forward and backward a large batch in micro-batches, feeding an ``Accumulate`` wrapper.

    Each call processes every row of the batch once, in order: one call can be one micro-step
    (``micro_batch_size`` >= the batch) or a whole window (``Accumulate(..., every_items=N)``
    with batches of N rows), or anything between; the wrapper applies the update at its
    accumulation boundary. Under AMP the wrapper's ``scaler`` is used
    (``scaler.scale(loss)``, ``scaler.step``, ``scaler.update`` per micro-batch).

    With ``"auto"`` the micro-batches per batch change as the search moves: build the wrapper
    with ``every_items=N`` (items per update; with ``every=k`` an update would cover k
    micro-batches of whatever size). A micro-batch is cut where the window fills at one item
    per row (:mod:`accumopt._cuts`): a window of rows holds exactly N of them, whatever the
    micro-batch size. A micro-batch attempt that runs out of memory leaves no trace: its
    gradient is dropped, and the buffers its forward pass updated (BatchNorm running statistics
    and ``num_batches_tracked``, any registered buffer of the model) and the random number
    generators it drew from (the CPU generator; the default CUDA generator of each CUDA device
    the model, the parameters or ``device`` are on) are restored from a snapshot taken before
    each attempt (see :mod:`accumopt._module_state`), so the run equals one that used the final
    sizes from the start. Buffers need the model: ``model=`` here, else the wrapper's
    (``model=`` or ``set_model``, at the time of the attempt); without either only gradients and
    generators are restored. Once a size has run for the batch's inputs, a window the call opens
    at that size runs without the rollback buffer and without a snapshot per attempt (one per
    window): its micro-steps add up in ``.grad`` as in a plain loop. Should one of them run out
    of memory after all (memory got scarcer), the window is dropped and run again from its first
    row at a smaller size, from that snapshot: nothing is lost or counted twice, and its earlier
    micro-batches are computed twice. Probes of a larger size (``grow_after``), a window carried
    over from the previous call, DDP and a ``GradScaler`` keep the buffer.

    Example:
        >>> import torch
        >>> from accumopt import Accumulate, MicroBatchRunner
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=32)
        >>> def loss_fn(batch):  # the micro-batch's summed loss, and the items it covers
        ...     x, y = batch
        ...     return ((model(x) - y) ** 2).sum(), len(x)
        >>> runner = MicroBatchRunner(opt, loss_fn, micro_batch_size="auto", model=model)
        >>> mean_loss = runner((torch.randn(32, 4), torch.randn(32, 1)))  # one update
        >>> opt.updates, runner.ooms
        (1, 0)

    Args:
        optimizer: the ``Accumulate`` wrapper to feed.
        loss_fn: called with each micro-batch (same nesting as the batch, tensors on
            ``device``). Returns the micro-batch's loss (a one-element tensor that requires
            grad), or ``(loss, items)`` where ``items`` is the number of items the loss covers
            (e.g. tokens that carry a loss; default: the micro-batch's rows), a number >= 0 or
            a one-element tensor, or ``(loss, items, outputs)`` with per-row ``outputs`` (a
            tensor or nesting of tensors, concatenated when ``return_outputs=True``). A result
            that breaks these rules is refused before the micro-batch's backward pass: the
            wrapper counts nothing for it. The runner runs and counts that backward pass;
            ``loss_fn`` must run none itself (README: "The runner's backward passes").
        micro_batch_size: rows per micro-batch (int >= 1), or ``"auto"``: start at
            ``start_size`` (default: the whole batch) and find the largest size that fits.
        device: where micro-batches run (None: leave tensors where they are). Host tensors
            bound for CUDA are pinned and copied with ``non_blocking=True``.
        loss_reduction: ``"sum"`` (default): ``loss`` is the sum over the micro-batch's
            items; ``"mean"``: ``loss`` is their mean (the runner multiplies it by ``items``).
            Either way each micro-batch is weighted by its item count, exactly.
        model: the module ``loss_fn`` runs. With ``"auto"``, its buffers are restored after a
            failed attempt (a clone of every buffer is taken before each attempt); it also
            warns once if it has BatchNorm layers in training mode and the micro-batch is small
            (see :mod:`accumopt.batchnorm`).
        start_size: the first size tried, an int >= 1, or None (the whole batch).
        tolerance: the search stops bisecting within this fraction of the size that fits,
            0 <= tolerance < 1.
        grow_after: clean micro-steps at a settled size before a 25 % larger size is probed,
            an int >= 1, or None (never).
        max_size: the largest size tried, an int >= ``start_size``, or None (no cap). The
            last four: see :class:`accumopt.autosize.MicroBatchSizer`.

    Raises:
        TypeError: ``optimizer`` is not an ``AccumulatingOptimizer``.
        ValueError: ``micro_batch_size`` is neither a positive int nor ``"auto"``;
            ``loss_reduction`` is not "sum"/"mean"; ``start_size``, ``tolerance``,
            ``grow_after`` or ``max_size`` is out of the ranges above.
        RuntimeError: ``"auto"`` with a wrapper that cannot drop a micro-step alone
            (``buffer=False``, an FSDP2 model: :meth:`Accumulate.enable_rollback`).
    """

    def __init__(
        self,
        optimizer: AccumulatingOptimizer,
        loss_fn: LossFn,
        *,
        micro_batch_size: int | Literal["auto"] = "auto",
        device: torch.device | str | None = None,
        loss_reduction: Literal["sum", "mean"] = "sum",
        model: torch.nn.Module | None = None,
        start_size: int | None = None,
        tolerance: float = 0.02,
        grow_after: int | None = 1000,
        max_size: int | None = None,
    ) -> None:
        if not isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError(
                f"MicroBatchRunner: optimizer is a {type(optimizer).__qualname__}; expected an "
                "accumopt.Accumulate wrapper (Accumulate(torch.optim.AdamW(...), every_items=N))."
            )
        auto = micro_batch_size == "auto"
        if auto and optimizer.every is not None:
            raise ValueError(
                f"MicroBatchRunner: micro_batch_size='auto' over Accumulate(every="
                f"{optimizer.every}), a window counted in micro-steps: the effective batch would "
                "follow the size search (an update covers whatever rows its micro-batches had); "
                "expected a window in items, Accumulate(..., every_items=N), so that every "
                "update covers N rows whatever the micro-batch size, or a fixed "
                "micro_batch_size."
            )
        if not auto and not positive_int(micro_batch_size):
            raise ValueError(
                f"MicroBatchRunner: micro_batch_size={micro_batch_size!r}; expected an int >= 1 "
                "or 'auto'."
            )
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(
                f"MicroBatchRunner: loss_reduction={loss_reduction!r}; expected 'sum' (loss_fn "
                "returns the summed loss) or 'mean' (it returns the mean over its items)."
            )
        check_search(
            "MicroBatchRunner", ("start_size", start_size), tolerance, grow_after, max_size
        )
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = torch.device(device) if device is not None else None
        self.loss_reduction = loss_reduction
        self.model = model
        self._fixed = None if auto else int(micro_batch_size)
        self._tolerance, self._grow_after, self._max_size = tolerance, grow_after, max_size
        self._start = start_size
        self.sizer: MicroBatchSizer | None = None
        self._history: list[tuple[str, int, str]] = []
        if auto:
            optimizer.enable_rollback()  # a failed micro-batch must be droppable alone

    # ------------------------------------------------------------------ read-outs

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size in use: where the ``"auto"`` search stands (a batch's last
        micro-batch may be shorter), or the fixed size."""
        return self._fixed if self.sizer is None else self.sizer.current

    @property
    def ooms(self) -> int:
        """Out-of-memory errors recovered from so far."""
        return 0 if self.sizer is None else self.sizer.ooms

    @property
    def history(self) -> list[tuple[str, int, str]]:
        """Every micro-batch size change: (inputs, new size, reason), the inputs written as
        ``"batch[0]: (3, 32, 32) float32, batch[1]: () int64"`` (each tensor leaf's shape
        past dim 0 and dtype: the search keeps one ceiling per such key)."""
        if self.sizer is None:
            return []
        described = self._history  # described once each, as the search appends them
        for key, size, why in self.sizer.history[len(described) :]:
            described.append((describe_key(key), size, why))
        return list(described)

    # ------------------------------------------------------------------ the loop

    def __call__(self, batch: Any, *, return_outputs: bool = False) -> Any:
        """Process every row of ``batch`` once; return the mean loss over its items.

        Args:
            batch: a tensor or nesting of tensors sharing dim 0 (any device; host memory is
                fine), non-tensor leaves passed to every micro-batch unchanged.
            return_outputs: also return the concatenated per-row outputs of ``loss_fn``.

        Returns:
            The batch's mean loss (detached, of the losses' shape: 0-dim for 0-dim losses, on
            the loss's device: the sum of the micro-batch losses over the sum of their items),
            or ``(mean_loss, outputs)``.

        Raises:
            RuntimeError: the wrapper refuses (a failed pass not dropped: ``opt.discard()``).
            NoMicroBatchFits: with ``"auto"``, a micro-batch of one row ran out of memory.
            TypeError: ``loss_fn`` returned something other than a loss tensor, ``(loss,
                items)`` or ``(loss, items, outputs)``, or a loss that is not a tensor, or (with
                ``return_outputs``) outputs holding a tensor whose rows cannot be concatenated:
                refused before that micro-batch's backward pass.
            ValueError: the batch is empty or its tensor leaves disagree on dim 0; ``loss_fn``
                returned a loss that is not a one-element tensor requiring grad, bad ``items``
                (not a finite number >= 0, nor a one-element tensor holding one), or outputs
                nested unlike the first micro-batch's: refused before that micro-batch's
                backward pass (the ones before it were trained, it and the rest were not; but
                see below for a window run without the rollback buffer).

        Other errors of ``loss_fn`` or of the backward pass propagate unchanged. With
        ``"auto"``, any error leaves the buffers and generators as they were before the
        micro-batch that raised it; in a window run without the rollback buffer (see the
        class), as they were when that window opened, and the window is dropped too.
        """
        self.optimizer._check_not_paused("backward")  # outside the attempts: no OOM of one
        if self.optimizer.will_update and (closed := self.optimizer._window.refusal(True)):
            raise closed[0](f"{closed[1]} MicroBatchRunner: nothing of this batch was run.")
        rows_of = _tree.RowSlicer(batch, self.device)  # the batch is flattened once
        scaler = self.optimizer.scaler
        scaler = scaler if scaler is not None and scaler.is_enabled() else None
        totals = Totals(return_outputs)
        if self._fixed is None:  # ranks agree on each outcome before any counts (a collective)
            with self.optimizer._counting_deferred(self.optimizer._ranks is not None):
                self._run_auto(rows_of, scaler, totals)
        else:  # never retried; cut at the window's end
            window, ranks = self.optimizer._window, self.optimizer._sync.world_size
            own = scaler is None and _own_steps(self.optimizer)  # read once per batch
            for piece, rows in _cuts.fixed_pieces(rows_of, self._fixed, window, ranks):
                warn_small_batchnorm(self.model, rows)
                totals.add(*self._forward_backward(piece, rows, totals, scaler), rows)
                self._step(scaler, own)
        return totals.result()

    def _run_auto(self, rows_of: _tree.RowSlicer, scaler: Scaler, totals: Totals) -> None:
        """The ``"auto"`` loop. An attempt of a size not proven for these inputs runs with the
        rollback buffer (a snapshot of the buffers and generators before it; one that runs out
        of memory is dropped alone and retried smaller). A window this call opens at a proven
        size runs without them (:class:`Opened`): its micro-steps stay in ``.grad``, and an
        out-of-memory error there restarts the window from its first row, smaller."""
        n, ranks = rows_of.rows, self.optimizer._ranks  # read now: set_model() may follow init
        if ranks is not None:
            ranks.check_same_rows(n, "MicroBatchRunner")
        key = rows_of.shape_key()
        offset = 0
        opened: Opened | None = None
        opt = self.optimizer
        # windows without the buffer: one process (ranks agree per micro-batch), no GradScaler
        may_open = ranks is None and scaler is None
        own = scaler is None and _own_steps(opt)  # read once per batch, as in the fixed loop
        while offset < n:
            fill = _cuts.room(opt._window, opt._sync.world_size)  # the window's end, if near
            size, proven = self._propose(key, n - offset, fill)
            if opened is not None and not proven:  # a larger size is probed: from here on
                opened = None  # each micro-batch is rolled back alone
            elif opened is None and proven and may_open and opt._rollback_off():
                opened = Opened(offset, totals.mark(), self._snapshot())
            if opened is None and not opt._buffer.buffer_all:  # the open window is folded
                opt.enable_rollback()
            state = self._snapshot() if opened is None else None
            failure, result = None, None
            try:
                piece = rows_of(offset, offset + size)
                result = self._forward_backward(piece, size, totals, scaler)
            except BaseException as err:  # re-raised below unless it is an OOM we handle
                if not is_oom(err):
                    self._undo(state, opened, offset)
                    raise
                failure = f"{type(err).__name__}: {err}"
            if ranks is not None:  # all ranks back off together, or none does
                failed_ranks = ranks.failed_ranks(failure is not None)
                if failed_ranks and failure is None:
                    failure = f"out of memory on {failed_ranks:g} other rank(s)"
                if failure is None:
                    opt._commit_deferred()
            if failure is not None:  # outside the except block: the traceback is gone
                piece = result = None
                if opened is None:
                    assert state is not None
                    self._recover(key, size, failure, state)
                else:  # the window starts again from its first row, at a smaller size
                    self._undo(None, opened, offset)
                    offset = opened.offset
                    totals.truncate(opened.mark)
                    opened = None
                    self._shrink(key, size, failure)
                continue
            assert result is not None and self.sizer is not None
            self.sizer.succeeded(key, size)
            self._step(scaler, own)
            totals.add(*result, size)
            offset += size
            if opened is not None and opt._window.micro_step == 0:  # the window was applied
                opened = None

    def _undo(self, state: ModuleState | None, opened: Opened | None, offset: int) -> None:
        """After a failed attempt at row ``offset``: restore what it changed (``state``), or drop
        the window opened without the rollback buffer and restore what changed since then."""
        if opened is None:
            assert state is not None
            state.restore()
            return
        self.optimizer.discard()
        opened.state.restore()
        if offset > opened.offset:
            logger.info(
                "window restarted at row %d of the batch after a failed micro-batch at row %d: "
                "its %d earlier rows are run again",
                opened.offset,
                offset,
                offset - opened.offset,
            )

    def _propose(self, key: Hashable, left: int, fill: int | None) -> tuple[int, bool]:
        """The next attempt's size (at most ``left`` rows and the window's room ``fill``) and if
        it ran before (``MicroBatchSizer.proven``); the search starts at start_size or ``left``."""
        if self.sizer is None:
            self.sizer = MicroBatchSizer(
                self._start or left,
                tolerance=self._tolerance,
                grow_after=self._grow_after,
                max_size=self._max_size,
            )
        size = self.sizer.propose(key, left if fill is None else min(left, fill))
        warn_small_batchnorm(self.model, size)
        return size, self.sizer.proven(key, size)

    def _forward_backward(
        self, piece: Any, rows: int, totals: Totals, scaler: Scaler
    ) -> tuple[Tensor, float, Any]:
        opt = self.optimizer
        with opt._counter.unhooked:  # the runner runs and counts the backward pass itself
            result = self.loss_fn(piece)
        loss, items, out = parse(result, rows)
        if totals.keep:  # before the backward pass: a micro-batch refused here is not counted
            check_outputs(out, totals.reference)
        if self.loss_reduction == "mean":  # ranks: the reducer waits for every gradient
            params = [] if opt._ranks is None else opt.param_groups
            loss = summed(loss, items, (p for g in params for p in g["params"]))
        opt._backward_here(loss if scaler is None else scaler.scale(loss), items)
        return loss.detach(), items, out  # not the graph: a ctx or hook may hold memory

    def _step(self, scaler: Scaler, own: bool) -> None:  # own: _own_steps(), read per batch
        opt = self.optimizer
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif own and opt._step_inside_window():
            return  # all that step() and zero_grad() do inside the window, done
        else:
            opt.step()
        opt.zero_grad()

    def _snapshot(self) -> ModuleState:
        """What the coming ``"auto"`` attempt may change outside the gradients: the buffers of
        the runner's model, else of the wrapper's (read now: ``set_model`` may come later)."""
        params = (p for g in self.optimizer.param_groups for p in g["params"])  # lazy: CUDA only
        model = self.optimizer.model if self.model is None else self.model
        return ModuleState(model, params, self.device)

    def _recover(self, key: Hashable, size: int, failure: str, state: ModuleState) -> None:
        """Roll back the failed micro-batch alone (its gradient, the buffers its forward pass
        updated, the random numbers it drew), free memory, shrink the next attempt."""
        self.optimizer.drop_micro_step()
        state.restore()
        self._shrink(key, size, failure)

    def _shrink(self, key: Hashable, size: int, failure: str) -> None:
        """Free memory and record the out-of-memory error at ``size`` (the next attempt is
        smaller); NoMicroBatchFits at one row."""
        free_memory()
        assert self.sizer is not None
        try:
            self.sizer.failed(key, size)
        except NoMicroBatchFits as err:
            raise NoMicroBatchFits(
                f"{err} Memory: {memory_report(self.device)}. Last error: {failure[:400]}"
            ) from None


def _own_steps(opt: AccumulatingOptimizer) -> bool:
    """Whether ``opt.step()`` and ``opt.zero_grad()`` are the wrapper's own: not overridden by a
    subclass, ``step`` not replaced on the instance (as by an LR scheduler)."""
    cls, own = type(opt), AccumulatingOptimizer
    own_methods = cls.step is own.step and cls.zero_grad is own.zero_grad
    return own_methods and "_step_replaced" not in opt.__dict__

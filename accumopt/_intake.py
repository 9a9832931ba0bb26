"""How a micro-step enters the window: the wrapper's intake side.

A backward pass ends (``BackwardCounter`` calls :meth:`MicroStepIntake._on_backward_end`), is
checked (non-finite policies, the window's refusals), and is counted into the window, which may
close it; or it is dropped alone (rollback). ``opt.backward(loss, items=n)`` and
``opt.next_items(n)`` give a pass its item count. The runner's package-internal interface
(its own backward passes, deferred counting agreed across ranks) lives here too.
:class:`MicroStepIntake` is a mixin of ``accumopt.accumulate.AccumulatingOptimizer``, which
owns every attribute it uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from accumopt import _checks, _guards, _refusals
from accumopt._backward_counter import BackwardCounter
from accumopt._window import Window
from accumopt._window_buffer import WindowBuffer
from accumopt.decorator import IN_FLIGHT
from accumopt.distributed import GradSync, LocalSync

_PER_MICRO_BATCH = ("skip_micro_batch", "raise")
_LOG = logging.getLogger("accumopt")


class MicroStepIntake:
    """The micro-step side of ``Accumulate`` (see the module docstring)."""

    # Owned and set by AccumulatingOptimizer.__init__
    param_groups: list[dict[str, Any]]
    nonfinite: str | None
    skipped_micro_steps: int
    did_update: bool
    buffer: bool | None
    _window: Window
    _buffer: WindowBuffer
    _sync: GradSync | LocalSync
    _counter: BackwardCounter
    _guard: _guards.WindowGuard
    _drop_at_step: bool
    _defer: bool
    _deferred: tuple[float | None] | None
    _pending_items: float | None
    _awaiting_end: bool
    _consistent: bool
    _close_window: Callable[[list[Tensor]], None]
    _window_params: Callable[[], list[Tensor]]
    _plan_sync: Callable[[], None]

    def backward(self, loss: Tensor, items: float | Tensor | None = None, **kwargs: Any) -> None:
        """Run ``loss.backward(**kwargs)`` as exactly one micro-step, weighted by ``items``.

        Args:
            loss: one-element tensor; with ``items``, the micro-batch's *summed* loss (the
                window's gradient is then the sum over the window's total items). Under AMP
                ``scaler.scale(loss)``. A pass that reaches no wrapped parameter still counts.
            items: how many items (samples, tokens) ``loss`` covers: a number >= 0 or a
                one-element tensor (one host sync).
            **kwargs: forwarded to ``Tensor.backward``.

        Raises:
            TypeError: ``loss`` is not a one-element tensor.
            ValueError: bad ``items``; weighted and unweighted micro-steps mixed in a window;
                an ``every_items`` window without ``items``.
            RuntimeError: the window is complete and waits for :meth:`step`, or a backward pass
                failed part-way. Nothing is accumulated by a rejected call.
        """
        _checks.check_loss(loss)
        weight = self._check_micro_step("backward", items)
        try:
            self._pending_items, self._awaiting_end = weight, True
            loss.backward(**kwargs)  # type: ignore[no-untyped-call]
            if self._awaiting_end:  # the pass reached no wrapped parameter / model output
                self._on_backward_end()
        finally:
            self._pending_items, self._awaiting_end = None, False

    def next_items(self, items: float | Tensor) -> None:
        """Say that the next backward pass covers ``items`` items, for a backward pass
        accumopt does not run (``accelerator.backward``, Lightning's ``manual_backward``, a
        Trainer's ``training_step``): then that pass is one micro-step weighted like
        ``opt.backward(loss_sum, items=items)``, and its loss must be the *summed* loss.

        Args:
            items: a number >= 0 or a one-element tensor (one host sync).

        Raises:
            ValueError: bad ``items``; a count is already waiting for its backward pass
                (:meth:`discard` drops it with the window); unweighted micro-steps in the
                window; several ranks without a DDP/FSDP2 model (see :meth:`set_model`).
            RuntimeError: the window is complete and waits for :meth:`step`, or a backward
                pass failed part-way. Nothing changes when it raises.
        """
        if items is None:
            raise ValueError(_refusals.NO_ITEMS)
        self._pending_items = self._check_micro_step("next_items", items)

    def _check_micro_step(self, api: str, items: float | Tensor | None) -> float | None:
        """Validate a coming micro-step's ``items`` against the window; returns the count."""
        if self._pending_items is not None:
            raise ValueError(_refusals.pending_items(api, self._pending_items))
        weight = _checks.check_items(items)
        refusal = self._window.refusal(weight is not None)
        if refusal is not None:
            raise refusal[0](f"{refusal[1]} Nothing was accumulated by this call.")
        self._check_not_paused(api)
        if weight is not None:
            self._sync.check_weighted()
        return weight

    def _check_not_paused(self, api: str) -> None:
        if self._counter.paused:  # a backward pass died part-way, its gradient in .grad
            raise RuntimeError(_refusals.paused_message(api, self._counter.paused_reason))
        if self._drop_at_step:
            raise RuntimeError(f"{_refusals.DROP_PENDING} {api}() changed nothing.")

    def _backward_here(self, loss: Tensor, items: float) -> None:
        """``MicroBatchRunner``'s backward pass of a micro-batch whose forward pass ran under
        ``_counter.unhooked`` (``loss``: checked by the runner; ``items``: its count; no
        ``Tensor.backward`` options): counted here when it returns, not by the counter's hooks
        and callbacks. Counting is paused while it runs (no hook the pass meets queues a
        callback, a nested pass counts nothing). A pass that dies, wherever it dies (before
        any gradient was written too, where the hooks would not have paused), leaves counting
        paused (reason ``""``) until ``drop_micro_step()`` or ``discard()``.

        After the window's first micro-step, a micro-step that none of the window's refusals
        can concern (no count waiting, a weighted window that is open, sized and not paused:
        ``items`` was checked by the runner) skips :meth:`_check_micro_step` but for the check
        that items are not counted by one rank of several without a DDP/FSDP2 model (a window
        restored from a checkpoint, or a process group set up since, may not have made it)."""
        window, counter = self._window, self._counter
        if (  # the usual micro-step: none of _check_micro_step's refusals can apply
            self._pending_items is None
            and window.micro_step
            and window.weighted
            and not window.closed
            and window.size_error is None
            and counter._armed[0]
        ):
            self._sync.check_weighted()
            weight: float | None = items
        else:  # the window's first micro-step, or a refusal
            weight = self._check_micro_step("backward", items)
        counter.pause("")
        self._pending_items = weight
        try:
            loss.backward()  # type: ignore[no-untyped-call]
            counter.pause("interrupted")
            self._end_micro_step(rearm=True, grouping=False)
        finally:
            self._pending_items = None

    def _on_backward_end(self) -> None:
        """End-of-backward callback: count the micro-step (or keep it for the runner).

        Counting stays paused (reason ``"interrupted"``) until this bookkeeping is done: the
        counter's end-of-pass callback re-arms after it returns; ``backward()`` of a pass that
        reached nothing (armed on entry) re-arms here."""
        self._end_micro_step(rearm=self._counter.pause("interrupted"))

    def _end_micro_step(self, rearm: bool, grouping: bool = True) -> None:
        """Count the micro-step whose backward pass ended, counting paused meanwhile; re-arm it
        after, if ``rearm``. A pass of an ``accumopt.apply`` call (``decorator.IN_FLIGHT``;
        never the runner's own, ``grouping=False``) joins the call's group instead: the
        first one of this wrapper waits for the call's end, the later ones are part of it."""
        items, self._pending_items, self._awaiting_end = self._pending_items, None, False
        group = IN_FLIGHT.group if grouping else None
        if group is not None and items is not None:  # apply's losses are means
            raise ValueError(f"{_refusals.WEIGHTED_IN_APPLY} {_refusals.UNREFUSABLE}")
        if group is not None and any(opt is self for opt in group):
            self._guard.absorbed += 1  # one more accumulation into .grad, same micro-step
        else:
            refusal = self._window.refusal(items is not None)
            if refusal is not None:
                raise refusal[0](f"{refusal[1]} {_refusals.UNREFUSABLE}")
            if self._drop_at_step:  # a dropped micro-step waits for scaler.step (gated AMP)
                raise RuntimeError(f"{_refusals.DROP_PENDING} {_refusals.UNREFUSABLE}")
            # did_update describes the last step() until the next micro-step (gated loops)
            self._window.stepped, self.did_update = False, False
            if self._defer:
                self._deferred = (items,)
            elif group is not None:
                group.append(self)
            else:
                self._count(items)
        if rearm:
            self._counter.rearm()

    def _transaction(self, body: Callable[[], Any]) -> Any:
        """Run ``body`` with counting paused (reason ``"interrupted"``) until it returns: an
        exception at any line leaves the wrapper refusing until ``discard()``, never half
        changed. Where ``body`` sets :attr:`_consistent` before a call that may raise (the
        inner optimizer's step, a refusal), that exception leaves the wrapper usable."""
        self._counter.pause("interrupted")
        self._consistent = False
        try:
            result = body()
        except BaseException:
            if self._consistent:
                self._counter.rearm()
            raise
        self._counter.rearm()
        return result

    def _count(self, items: float | None) -> None:
        if self.nonfinite in _PER_MICRO_BATCH and self._buffer.in_flight_nonfinite(
            self._window_params()
        ):
            if self.nonfinite == "raise":
                self._drop()
                raise FloatingPointError(_refusals.nonfinite_message(self._window.micro_step + 1))
            self.skipped_micro_steps += 1
            _LOG.info("Accumulate: micro-step dropped (inf/NaN in its gradient)")
            # GradScaler.step must still see the inf to back off its scale: drop it there
            self._drop_at_step = self._buffer.loss_scale() is not None
            return None if self._drop_at_step else self._drop()
        if self._window.count(self._sync.counted(items, self._window)):
            self._close_window(self._window_params())
        else:
            self._buffer.micro_step_done(self._window_params)
            self._plan_sync()
            if self._window.micro_step == 1:
                _guards.note(self)  # type: ignore[arg-type]  # the mixin's owner
            elif self._buffer.unfolded == 1:  # AMP: the first one in .grad since a fold
                _guards.note_grads(self)  # type: ignore[arg-type]
        return None

    def drop_micro_step(self) -> None:
        """Drop the micro-step in flight (``.grad`` set to None), keeping every finished one
        (``buffer=True``, :meth:`enable_rollback`). Raises RuntimeError if the window is
        complete or finished micro-steps live in ``.grad``."""
        if self._counter.paused_reason == "interrupted":
            raise RuntimeError(_refusals.paused_message("drop_micro_step", "interrupted"))
        self._drop()

    def _drop(self) -> None:
        if self._window.closed or not self._buffer.separable(self._window.micro_step):
            raise RuntimeError(_refusals.inseparable_message(self._window.closed))
        for p in self._window_params():
            p.grad = None
        _LOG.debug("Accumulate: the micro-step in flight was dropped")
        self._pending_items = None
        self._counter.rearm()
        if self._deferred is not None:
            self._deferred = None
            self._window.stepped = True

    def enable_rollback(self) -> None:
        """Route every parameter through the window buffer from now on (``buffer=True``), so
        that a failed micro-batch can be dropped alone; callable between micro-steps.

        Raises:
            RuntimeError: the wrapper was built with ``buffer=False``, or holds an FSDP2 model.
        """
        _refusals.check_rollback(self.buffer, self._sync.fsdp)
        self._check_not_paused("enable_rollback")
        self._transaction(self._route_all)

    def _rollback_off(self) -> bool:
        """Keep the window that opens next in ``.grad`` (no rollback buffer), where that is the
        wrapper's default (no ``buffer=True``, no per-micro-batch non-finite policy); returns
        whether it did. The runner's proven sizes; only between windows."""
        if self.buffer is True or self.nonfinite in _PER_MICRO_BATCH or self._window.micro_step:
            return False
        self._buffer.buffer_all = False
        self._buffer.forget_params()
        return True

    def _route_all(self) -> None:
        params = self._window_params()
        if not self._buffer.unfolded:  # under AMP the micro-steps stay in .grad, noted
            self._guard.forget_grads()  # else the window moved out of .grad on purpose
        self._buffer.route_all(params, self._window.micro_step, self._window.closed)
        self._plan_sync()

    # The runner's interface (package-internal), under torch.distributed: after each
    # micro-batch all ranks agree that none ran out of memory, then all count or all drop it.

    @property
    def _ranks(self) -> GradSync | None:
        """The cross-rank synchronisation (None in a single process)."""
        return self._sync if isinstance(self._sync, GradSync) else None

    @contextmanager
    def _counting_deferred(self, on: bool) -> Iterator[None]:
        """While the block runs (if ``on``), keep each finished micro-step uncounted until
        :meth:`_commit_deferred` (or :meth:`drop_micro_step`); after it, micro-steps are
        counted as they end again (a plain loop between two runner calls)."""
        self._defer = on
        try:
            yield
        finally:
            self._defer = False

    def _commit_deferred(self) -> None:
        """Count the micro-step kept back since its backward pass ended (if any)."""
        pending, self._deferred = self._deferred, None
        if pending is not None:
            self._commit_deferred_as(pending[0])

    def _commit_deferred_as(self, items: float | None) -> None:
        """Count a micro-step kept back since its backward passes ended, with ``items``."""
        self._transaction(lambda: self._count(items))

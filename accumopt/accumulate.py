"""Gradient accumulation as an optimizer wrapper: ``Accumulate(optimizer, every=N)``.

The torch.optim facade. It composes the parts that decide, and decides nothing they decide:

- ``_backward_counter.BackwardCounter``: sees each backward pass end (one micro-step);
- ``_window.Window``: counts micro-steps and items, says when the window closes and what it
  divides by;
- ``_window_buffer.WindowBuffer``: where finished micro-steps live (``.grad`` or a float32
  buffer; AMP folding; rollback) and how the window's gradient is formed at the boundary;
- ``distributed.GradSync``: every cross-rank decision and collective (DDP/FSDP2);
- ``_checkpoint``: the state-dict format and pickling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from threading import get_ident
from typing import Any

import torch
from torch import Tensor

from accumopt import _binding, _checkpoint, _checks, _guards, _noise_attach, _refusals, noise
from accumopt._foreign import accumulation as foreign_accumulation
from accumopt._grads import params_of, same_listing
from accumopt._inner import any_step_hooks, watch_steps
from accumopt._intake import _PER_MICRO_BATCH, MicroStepIntake
from accumopt._window import SizeFn, Window, WindowReport
from accumopt._window_buffer import WindowBuffer
from accumopt.decorator import held_by_call

_LOG = logging.getLogger("accumopt")


class AccumulatingOptimizer(MicroStepIntake, torch.optim.Optimizer):
    """Wrap any ``torch.optim.Optimizer`` so that it steps once per window of micro-batches.

    Example::

        opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=3e-4), every=8, model=model)
        for x, y in loader:                      # micro-batches
            F.cross_entropy(model(x), y).backward()
            opt.step()        # the inner optimizer steps on every 8th backward pass only
            opt.zero_grad()   # clears .grad only after a real step

    Each backward pass into a wrapped parameter is one micro-step. When the window completes,
    ``.grad`` holds its gradient (the mean over micro-steps; with ``opt.backward(loss_sum,
    items=n)`` the summed loss over the window's items; the sum for ``reduction="sum"``) and
    :attr:`will_update` is True; :meth:`step` clips and steps the inner optimizer.

    Args:
        optimizer: any ``torch.optim.Optimizer`` but LBFGS; its ``param_groups``, ``state`` and
            ``defaults`` are shared (schedulers, clipping and checkpoints work unchanged).
        every: micro-steps per update (int >= 1), or ``every_items``: items per update; either
            may be a schedule (``accumopt.schedules``). noise_scale: see ``accumopt.noise``.
        reduction: ``"mean"`` (default) or ``"sum"`` (padertorch's summed gradients).
        max_grad_norm: clip the window's unscaled gradient to this 2-norm before the step
            (``inf``: measure it only, :attr:`last_window`); the attribute may be set
            between steps (read at each boundary).
        scaler: the ``torch.amp.GradScaler`` of ``scaler.step(opt)``: each micro-step is
            unscaled with its own loss scale.
        buffer: where finished micro-steps are summed: None, a float32 buffer for bf16/fp16
            parameters; True, every parameter (rollback); False, never.
        nonfinite: inf/NaN micro-batches: None (unchecked), ``"skip_window"``,
            ``"skip_micro_batch"`` (optax ``skip_not_finite``) or ``"raise"``.
        model: the model the losses come from (the documented setting for an ``nn.Module``):
            counting at its outputs, one hook per forward call (without it: one hook per
            parameter tensor per backward pass); with DDP or FSDP2, one gradient sync per
            update and items summed over the ranks.
        reduce_every_micro_step: synchronise every micro-step, not the closing one.

    Attributes:
        optimizer: the inner optimizer. updates (int): inner steps applied. did_update (bool):
            whether the last :meth:`step`/:meth:`flush` updated (False again once the next
            micro-step is counted). skipped_micro_steps (int). last_window
            (:class:`~accumopt._window.WindowReport` | None): the last boundary.

    Raises:
        TypeError: ``optimizer`` not an optimizer, already wrapped, or LBFGS; ``scaler`` not
            a ``GradScaler``; ``model`` not an ``nn.Module``.
        ValueError: a setting out of range or a combination accumopt cannot honour exactly;
            ``model`` holds none of the optimizer's parameters.

    References:
        optax ``MultiSteps``; Megatron-LM ``calculate_per_token_loss``; PyTorch's AMP
        examples ("Gradient accumulation").
    """

    _step_supports_amp_scaling = True  # GradScaler.step hands us grad_scale and found_inf
    _pending_items: float | None
    _deferred: tuple[float | None] | None
    _accumopt_wrapper = True  # what _checks.check_optimizer refuses to wrap again
    _inner_stepping = False  # only the wrapper may step the inner optimizer (_inner.py)
    model: torch.nn.Module | None  # set by _binding.bind

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        every: int | SizeFn | None = None,
        *,
        every_items: float | SizeFn | None = None,
        reduction: str = "mean",
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        buffer: bool | None = None,
        nonfinite: str | None = None,
        model: torch.nn.Module | None = None,
        reduce_every_micro_step: bool = False,
        noise_scale: bool | noise.NoiseScale = False,
    ) -> None:
        inner = _checks.check_optimizer(optimizer)
        every, every_items = _checks.check_window(every, every_items)
        self.reduction = _checks.check_reduction(reduction)
        self.max_grad_norm = _checks.check_max_grad_norm(max_grad_norm)
        self.scaler = _checks.check_scaler(scaler)
        self.buffer = _checks.check_buffer(buffer)
        self.nonfinite = _checks.check_nonfinite(nonfinite)
        # Base init on copies of the groups, then share the inner's containers by identity
        super().__init__([dict(g) for g in inner.param_groups], inner.defaults)
        self.optimizer, self.param_groups = inner, inner.param_groups
        self.state, self.defaults = inner.state, inner.defaults
        self.updates, self.skipped_micro_steps, self.did_update = 0, 0, False
        self.last_window: WindowReport | None = None
        self.reduce_every_micro_step = bool(reduce_every_micro_step)
        self._window = Window(every, every_items, self.reduction)
        buffer_all = self.buffer is True or self.nonfinite in _PER_MICRO_BATCH
        self._buffer = WindowBuffer(self.buffer, buffer_all, self.scaler)
        self._guard = _guards.WindowGuard()
        self._drop_at_step = False  # a non-finite micro-batch, kept until GradScaler saw it
        self._thread: int | None = None  # the thread that steps the wrapper (the first one)
        self._defer, self._deferred = False, None  # the runner's deferred counting
        self._pending_items, self._awaiting_end = None, False  # opt.backward()'s pass
        self._listed: list[Tensor] | None = None  # the last listing (_window_params)
        _binding.bind(self, model)  # sets model, _sync (DDP/FSDP2) and _counter
        self.noise_scale = _noise_attach.attach(self, noise_scale)  # off: None, and nothing runs
        _checks.claim(inner, self)
        self._inner_steps = watch_steps(inner, self)

    every = property(lambda self: self._window.every, doc="Micro-steps per window, or None.")
    every_items = property(lambda self: self._window.every_items, doc="Items per window, or None.")
    micro_step = property(lambda self: self._window.micro_step, doc="Micro-steps in the window.")
    items = property(lambda self: self._window.items, doc=_refusals.ITEMS)
    will_update = property(lambda self: self._window.closed, doc=_refusals.WILL_UPDATE)
    _opt_called = _guards.scheduler_handshake  # how torch's LR schedulers are seen

    def _window_params(self) -> list[Tensor]:
        """The wrapped parameters in state-dict order, listed afresh at every call (groups added
        to the inner optimizer or edited inside a window are seen), as the same list object
        while they do not change (the window guard's read of ``.grad`` is reused at the close
        only for that object)."""
        self._listed = same_listing(self._listed, params_of(self.param_groups))
        return self._listed

    def _close_window(self, params: list[Tensor]) -> None:
        """Form the window's gradient in ``.grad`` (divided once, over all ranks)."""
        grads = _guards.check_close(self, params)
        self._window.closed = True
        self._sync.settle_items(self._window)
        divisor = self._window.divisor(self._sync.world_size)
        self._sync.close(self._buffer, params, divisor, grads)

    def _plan_sync(self) -> None:
        self._sync.plan_next(self._window, self._buffer, self.param_groups)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """End a micro-step; at the boundary clip, step the inner optimizer, set
        :attr:`did_update`. Inside the window nothing happens (under AMP: a fold).

        Args:
            closure: as for every torch optimizer (Lightning passes one): called once, with
                autograd on, before the step; it runs the micro-step's forward and backward.

        Returns:
            The closure's return value (the loss), or None without a closure.

        A zero step from ``torch.distributed.checkpoint``'s state initialisation (no backward
        pass, every lr 0, zero gradients, no inner state) is run as DCP expects.

        Raises:
            RuntimeError: no backward pass since the last ``step()``; a backward pass failed
                part-way (see :meth:`discard`); a learning rate changed inside the window; a
                boundary with ``scaler=`` but not through ``scaler.step``; ``scaler.unscale_``
                inside an open window. Anything the closure raises, before any step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._step_inside_window():
            return loss
        if any_step_hooks(self):
            self._profiled_step()
        else:
            self._step()
        return loss

    def _step_inside_window(self) -> bool:
        """``step()`` after a plain micro-step inside the window: mark it stepped, and return
        True; False (nothing done) where step() has more to do: a boundary, step hooks, AMP, a
        micro-step to drop, a paused counter, another thread, no backward pass since."""
        window = self._window
        slow = window.closed or window.stepped or self._drop_at_step or any_step_hooks(self)
        amp = "found_inf" in self.__dict__
        if slow or amp or not self._counter._armed[0] or self._thread != get_ident():
            return False
        window.stepped, self.did_update = True, False
        return True

    # No Optimizer profiler/hook wrapper (~30 us a call) unless step hooks exist (see above);
    # an LR scheduler replacing step on the instance is recorded (_guards.StepSlot)
    step = _guards.StepSlot(step)

    def _step(self) -> None:
        amp = "found_inf" in self.__dict__  # set by GradScaler.step for the duration of step()
        if self._window.stepped and not amp and _checkpoint.dcp_init_step(self):
            return None  # torch.distributed.checkpoint's state initialisation (a zero step)
        if self._thread is None:
            self._thread = get_ident()
        elif self._thread != get_ident():  # a second thread: refused there and everywhere
            self._counter.pause("thread")
        with _binding.scaler_call(self):
            if amp and self.scaler is None:  # scaler.step(opt), a wrapper built without scaler=
                _binding.adopt_scaler(self)
            scaled = self._buffer.loss_scale() is not None and not self._buffer.unscaled
            problem = _refusals.step_refusal(amp, scaled, self)
            if problem is not None:
                raise problem
            if self._window.closed and (foreign := foreign_accumulation(self)) is not None:
                raise RuntimeError(foreign)
            self._transaction(partial(self._step_body, amp))

    def _step_body(self, amp: bool) -> None:
        grad_scale: Tensor | None = self.__dict__.get("grad_scale")
        closed = self._window.closed  # a boundary counts as stepped once the inner step ran
        self._window.stepped, self.did_update = not closed, False
        if self._drop_at_step:
            self._drop_at_step = False
            self._drop()
            return
        params = self._window_params()
        if amp:  # under DDP/FSDP2 the ranks first agree on the inf/NaN flag (one all-reduce)
            found = self._buffer.inf_flag(self, self.__dict__["found_inf"])
            found = self._sync.agreed_found_inf(self.scaler, self, found)
            _guards.scaler_step(self, params, grad_scale, found)
        if closed:
            self._finish_window(params)
            self._window.stepped = True

    _profiled_step = torch.optim.Optimizer.profile_hook_step(_step)

    def _finish_window(self, params: list[Tensor], clear_grads: bool = False) -> None:
        """Step the inner optimizer on the window's gradient (or skip it), clear the gradients
        if ``clear_grads`` (``flush()``), then reset. Retried after any failure (inside a
        transaction), it does what is left: whether the update was applied is read from the
        inner optimizer's step count against the count before the window's first attempt (so an
        update is never applied twice), and the skip decision is taken once. Until the reset the
        window stays closed (so a checkpoint refuses it, see ``_checkpoint.check_settled``). A
        failure after the update (a post-step hook, the schedule's next size) clears ``.grad``:
        the caller's ``zero_grad()`` may not come; the spent gradient must not join the next."""
        if self._window.inner_base is None:  # the first attempt
            self._window.inner_base = self._inner_steps[0]
        base: int = self._window.inner_base
        try:
            self._apply_window(params, clear_grads, base)
        except BaseException:
            if self._inner_steps[0] > base:  # interrupted here: refusing until discard()
                consistent, self._consistent = self._consistent, False
                self.optimizer.zero_grad(set_to_none=True)
                self._consistent = consistent
            raise

    def _apply_window(self, params: list[Tensor], clear_grads: bool, base: int) -> None:
        window = self._window  # a failure leaves a window that a retried step() finishes (it
        self._consistent = True  # redoes only what is left), but while clipping in place
        if window.skip is None:
            finite = self.nonfinite == "skip_window"
            window.skip = window.divisor() is None or self._buffer.skip_window(params, finite)
        try:
            if window.skip:
                self.optimizer.zero_grad(set_to_none=True)
                _LOG.info("Accumulate: window %d skipped (inf/NaN or no items)", self.updates + 1)
            elif self._inner_steps[0] == base:
                _guards.check_lr(self)  # a scheduler stepped every micro-step: nothing applied
                self._consistent = False
                self._buffer.finalize(params, self.max_grad_norm)  # clipped once, even retried
                self._inner_stepping = self._consistent = True
                self.optimizer.step()  # raising before or after updating, the window stays
        finally:  # closed (step() retries); applied is counted at once, a post hook raising
            self._inner_stepping = False
            if self._inner_steps[0] > base:
                self.updates, self.did_update = window.applied(self.updates), True
        self.last_window = window.report(self._buffer.grad_norm, self.did_update)
        if clear_grads:  # before the reset: a failure here leaves the window closed, retried
            self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()  # a schedule's bad size for the next one raises after it

    def flush(self) -> bool:
        """Apply the open, partial window now (epoch end), then clear the gradients; returns
        whether it updated (:attr:`did_update`). RuntimeError after a failed pass (discard());
        when it raises after the update began, ``flush()`` again finishes it (never twice)."""
        self._check_not_paused("flush")
        self.did_update = False
        self._sync.release(self._window, flushing=True)  # all ranks flush; DDP syncs again
        if self._window.micro_step == 0:
            return False
        return bool(self._transaction(self._flush))

    def _flush(self) -> bool:
        params = self._window_params()
        if not self._window.closed:
            self._close_window(params)
        self._buffer.unscale_closed(params)
        self._finish_window(params, clear_grads=True)
        self._window.stepped = True
        return self.did_update

    def discard(self) -> None:
        """Drop the open window (gradients and counters; the inner optimizer is untouched): the
        way out after a backward pass that failed part-way (also :meth:`drop_micro_step`)."""
        self._counter.pause("interrupted")  # re-armed once done: an interrupted discard() refuses
        self._restart(clear_grads=True)
        self._sync.release(self._window)
        self.did_update = False

    def _restart(self, clear_grads: bool) -> None:
        """An empty window, no count waiting, counting re-armed (discard(), a checkpoint load)."""
        if clear_grads:
            self.optimizer.zero_grad(set_to_none=True)
        self._window.stepped, self._pending_items, self._drop_at_step = True, None, False
        try:
            self._reset_window()
        except ValueError:  # a schedule's bad size: the empty window is open, usable once fixed
            self._counter.rearm()
            raise
        self._counter.rearm()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients only when no window is open (nor an ``accumopt.apply`` call holds a
        pass): else a no-op, so it never wipes a window (:meth:`discard` drops one)."""
        if self._window.micro_step == 0 and not held_by_call(self):
            # paused until done, re-armed at the end (no gradient is left over): an
            # interrupted zero_grad() refuses until discard()
            self._counter.pause("interrupted")
            self.optimizer.zero_grad(set_to_none=set_to_none)
            # once per window: count parameters unfrozen since the last look
            self._counter.watch_groups(self.param_groups)
            self._counter.rearm()

    def _reset_window(self) -> None:
        self._guard.forget()
        self._buffer.reset()
        self._window.reset(opened=self._plan_sync)  # a schedule's bad size raises after it

    def set_model(self, model: torch.nn.Module, *, count_at: str = "outputs") -> None:
        """Tell the wrapper the model its losses come from, after it was built: the same as
        ``Accumulate(..., model=model)``. For frameworks that wrap the model (DDP, FSDP2) after
        the optimizer exists: Accelerate's ``prepare``, the HF Trainer, Lightning strategies.
        ``count_at="parameters"`` counts backward passes at the parameters (not at the
        model's outputs) while syncing through the model: for a backward pass run inside the
        model's forward (Lightning's ``manual_backward`` under DDP); not for FSDP2.

        Raises:
            RuntimeError: a window is open (call it between windows: before the first
                backward pass, or right after an update); a backward pass failed part-way.
            TypeError / ValueError: as ``model=`` (not a module, none of the parameters, a
                setting the model cannot honour). Nothing changes when it raises.
        """
        if self._window.micro_step:
            raise RuntimeError(_refusals.SET_MODEL_IN_WINDOW)
        self._check_not_paused("set_model")
        _binding.bind(self, model, count_at)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (and count backward passes through it)."""
        inner = self.__dict__.get("optimizer")
        if inner is None:  # Optimizer.__init__ filling our throw-away copies
            super().add_param_group(param_group)
            return
        inner.add_param_group(param_group)
        self._buffer.forget_params()
        self._counter.watch(self.param_groups[-1]["params"])

    # The checkpoint format lives in one place; its functions are these methods.
    state_dict = _checkpoint.state_dict

    load_state_dict = _checkpoint.load_state_dict
    __getstate__ = _checkpoint.getstate
    __setstate__ = _checkpoint.setstate

    def __repr__(self) -> str:
        every, every_items = self._window.every, self._window.every_items
        window = f"every={every}" if every else f"every_items={every_items:g}"
        return f"Accumulate({window}, reduction={self.reduction!r}, optimizer={self.optimizer!r})"


Accumulate = AccumulatingOptimizer
"""Short public name of :class:`AccumulatingOptimizer`."""

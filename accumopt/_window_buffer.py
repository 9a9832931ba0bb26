"""Where the finished micro-steps of the open window live: ``.grad``, or the window buffer.

By default the micro-steps of a window accumulate in ``.grad`` (no copy, no extra memory). The
window buffer moves a micro-step's gradient out of ``.grad`` into a per-parameter sum right
after it is complete. Three jobs share that one mechanism:

- **AMP**: each micro-step is unscaled with the loss scale it was computed under (folded at
  ``scaler.step(opt)``), so a scale change inside a window cannot mix two scales; an inf/NaN
  seen by any micro-step is remembered and skips the window.
- **Precision**: bf16/fp16 gradients are summed in float32, so the rounding error of the sum
  does not grow with the number of micro-steps (DeepSpeed's ``BF16_Optimizer`` and Megatron's
  ``main_grad`` do this inside their engines). From a window's second micro-step on, each
  gradient is folded as soon as autograd has accumulated it (``_fold_hooks``), so the sums and
  at most one bf16/fp16 gradient coexist (about 2x the parameter bytes, not 3x); not under
  AMP, rollback or ``torch.distributed``, which keep the fold at the micro-step's end.
- **Rollback**: the micro-step in flight is separable: after an out-of-memory error or a
  non-finite gradient, dropping ``.grad`` removes it alone and keeps every finished one.

At the boundary :meth:`WindowBuffer.close` merges the buffer and ``.grad`` into the window's
gradient, in ``.grad``. Memory: one buffer tensor per buffered parameter, in
``promote_types(param dtype, float32)``, only while a window is open. Peak for a bf16 model
under the default policy, gradients and sums together: 2x the parameter bytes plus its
largest parameter's (``bench/memory_bf16.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

import torch
from torch import Tensor

from accumopt import _grads
from accumopt._fold_hooks import FoldHooks, fold_one, single_process

_LOW_PRECISION = frozenset((torch.bfloat16, torch.float16))
_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")
_NONES = repeat(None)


def buffer_dtype(param: Tensor) -> torch.dtype:
    """The dtype a parameter's gradient is summed in: at least float32."""
    return torch.promote_types(param.dtype, torch.float32)


class WindowBuffer:
    """The finished micro-steps of the open window that do not live in ``.grad``.

    Args:
        policy: the wrapper's ``buffer`` argument: None (bf16/fp16 parameters only), True
            (every parameter), False (none).
        buffer_all: route every parameter through the buffer (``buffer=True``, per-micro-batch
            non-finite policies, OOM rollback).
        scaler: the ``GradScaler`` the loop steps through, or None.

    Attributes:
        sums (dict[Tensor, Tensor]): parameter -> sum of its folded, unscaled gradients.
        found_inf (Tensor | None): 0-dim float32, > 0 when a micro-step of the window had an
            inf/NaN under AMP; None before the first ``scaler.step``.
        unfolded (int): counted micro-steps whose (scaled) gradient is still in ``.grad``,
            waiting for ``scaler.step`` to fold it with its own loss scale.
        folding (bool): low-precision gradients are folded as autograd accumulates them (the
            open window has a finished micro-step; default policy, no scaler, no rollback, no
            process group). The micro-step in flight is then mixed into the sums.

    Every method that needs the parameters takes them (``params``: the wrapped parameters in
    state-dict order), so the buffer holds no reference back to the optimizer.
    """

    def __init__(
        self, policy: bool | None, buffer_all: bool, scaler: torch.amp.GradScaler | None
    ) -> None:
        self.policy, self.buffer_all, self.scaler = policy, buffer_all, scaler
        self.sums: dict[Tensor, Tensor] = {}
        self._hooks = FoldHooks(self.fold_accumulated)
        self.reset()

    def __bool__(self) -> bool:  # whether any sum is held
        return bool(self.sums)

    def reset(self) -> None:
        """Forget the window (a new one opens)."""
        self._buffered: list[Tensor] | None = None  # listed again each window: dtypes may change
        self.sums.clear()
        self.found_inf: Tensor | None = None
        self.unfolded = 0
        self.final = False  # the closed window's gradient is unscaled and clipped
        self.unscaled = False  # the closed window's gradient was divided by the loss scale
        self.grad_norm: Tensor | None = None  # its pre-clip norm, when clipping is on
        self.folding = False  # from the window's first finished micro-step on
        self._forget_order()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickling) keeps the sums, not the hooks: they live on
        the original's parameters; the copy hooks its own at its next micro-step."""
        state = self.__dict__.copy()
        del state["_hooks"]
        state["folding"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hooks = FoldHooks(self.fold_accumulated)

    def loss_scale(self) -> Tensor | None:
        """The scaler's current loss scale as a tensor (no host sync), or None without AMP."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return self.scaler._get_scale_async()

    def buffered_params(self, params: list[Tensor]) -> list[Tensor]:
        """The parameters whose micro-steps go to the buffer (listed once a window)."""
        buffered = self._buffered
        if buffered is None:
            if self.policy is False:
                buffered = []
            elif self.buffer_all:
                buffered = params
            elif _LOW_PRECISION.isdisjoint(map(_DTYPE, params)):  # one C-level pass
                buffered = []
            else:
                buffered = [p for p in params if p.dtype in _LOW_PRECISION]
            self._buffered = buffered
        return buffered

    def forget_params(self) -> None:
        """The parameter list changed (a group was added, a checkpoint loaded): list again."""
        self._buffered = None

    def grad_only(self, params: list[Tensor]) -> bool:
        """Whether every finished micro-step stays in ``.grad`` (no buffer, no AMP folding):
        then DDP's own reducer may synchronise the closing micro-step."""
        return not self.buffered_params(params) and self.loss_scale() is None

    # ------------------------------------------------------------------ during the window

    def micro_step_done(self, params_of: Callable[[], list[Tensor]]) -> None:
        """A micro-step that does not close the window was counted: fold it now (``params_of()``
        lists the parameters, when needed), or under AMP leave it for ``scaler.step``."""
        if self.scaler is not None and self.loss_scale() is not None:
            self.unfolded += 1
        elif self._buffered != []:  # the common fp32 case: nothing to fold, nothing to list
            params = self._buffered or self.buffered_params(params_of())  # None: list them
            if not params:  # listed now: nothing buffered in this window
                return
            self.fold(params, None)  # what .grad holds: the first micro-step, sparse gradients
            if not self.folding:
                self._start_folding(params)

    def _start_folding(self, params: list[Tensor]) -> None:
        """The open window has a finished micro-step: fold the next ones' low-precision
        gradients as autograd accumulates them, where the in-flight micro-step need not stay
        separable and nothing else reads ``.grad`` (see :attr:`folding`). The window's first
        micro-step is never folded early: the noise scale reads it in ``.grad``, and a
        backward pass that dies in it leaves its partial gradient in ``.grad`` alone
        (``zero_grad()`` or ``drop_micro_step()`` clear it); one that dies later leaves
        counting paused until ``discard()`` (:meth:`reset`)."""
        allowed = self.policy is None and not self.buffer_all and self.scaler is None
        if allowed and single_process():
            self._hooks.watch(params)  # hooks registered once per parameter
            self.folding = True
        else:
            self._hooks.remove()

    def fold_accumulated(self, param: Tensor) -> None:
        """The post-accumulate-grad hook: fold ``param.grad`` into its sum and release it,
        while :attr:`folding` (a scaler adopted since, or a parameter no longer in
        low precision: left in ``.grad``, as without the hook)."""
        if self.folding and self.scaler is None and param.dtype in _LOW_PRECISION:
            fold_one(self.sums, param, buffer_dtype(param))

    def fold_scaled(self, params: list[Tensor], grad_scale: Tensor | None) -> None:
        """``scaler.step(opt)`` inside the window: fold every parameter, unscaled by the loss
        scale its micro-steps were computed under."""
        self.fold(params, grad_scale)
        self.unfolded = 0

    def scaler_step(
        self, params: list[Tensor], grad_scale: Tensor | None, found_inf: Tensor, closed: bool
    ) -> None:
        """``scaler.step(opt)`` hands the wrapper the loss scale and the inf/NaN flag of the
        micro-step: remember the flag; inside the window fold every parameter unscaled by its
        own scale; at the boundary unscale the window's gradient."""
        if self.final:  # a retried step() after the inner step failed: nothing to redo
            return
        self.note_found_inf(found_inf)
        if not closed:
            self.fold_scaled(params, grad_scale)
        elif grad_scale is not None and not self.unscaled:  # not again on a retried step()
            _grads.div_(_grads.grads_of(params), grad_scale)
            self.unscaled = True

    def inf_flag(self, opt: object, found_inf: Tensor | int) -> Tensor:
        """The micro-step's inf/NaN flag as ``GradScaler.step`` hands it. A micro-step that
        reached no wrapped gradient has none (the scaler hands ``0``): a zero flag is recorded
        in the scaler too, or ``scaler.update()`` would refuse ("No inf checks were recorded")
        while the same loop without AMP counts the micro-step with a zero gradient."""
        if isinstance(found_inf, Tensor):
            return found_inf
        assert self.scaler is not None
        scale = self.scaler._get_scale_async()
        assert scale is not None  # GradScaler.step ran: the scale exists
        zero = torch.zeros((), dtype=torch.float32, device=scale.device)
        states = self.scaler._per_optimizer_states[id(opt)]
        states["found_inf_per_device"][scale.device] = zero
        return zero

    def note_found_inf(self, found_inf: Tensor) -> None:
        """Remember a micro-step's inf/NaN flag (0-dim tensor, no host sync)."""
        self.found_inf = found_inf if self.found_inf is None else self.found_inf + found_inf

    def separable(self, micro_step: int) -> bool:
        """Whether the micro-step in flight can be dropped alone: no finished micro-step of
        the window (``micro_step`` of them) lives in ``.grad``."""
        return not self.unfolded and (micro_step == 0 or self.buffer_all)

    def in_flight_nonfinite(self, params: list[Tensor]) -> bool:
        """Whether the gradient in ``.grad`` holds an inf/NaN (one host sync). False when
        finished micro-steps are mixed in (PyTorch's gated AMP recipe): the scaler then skips
        the window at the boundary if needed."""
        if self.unfolded:
            return False
        return not _grads.all_finite(_grads.grads_of(params))

    def route_all(self, params: list[Tensor], micro_step: int, closed: bool) -> None:
        """Route every parameter through the buffer from now on (rollback); what the open window
        holds in ``.grad`` is folded first, unless it waits there, scaled, for scaler.step."""
        if self.buffer_all:
            return
        self.buffer_all, self._buffered = True, None
        self.folding = False  # the micro-step in flight must stay separable from now on
        self._hooks.remove()
        if micro_step and not closed and not self.unfolded:  # AMP's wait for scaler.step
            self.fold(params, None)

    # ------------------------------------------------------------------ the boundary

    def close(
        self, params: list[Tensor], divisor: float | None, grads: list[Tensor | None] | None = None
    ) -> None:
        """Write the window's gradient into ``.grad``: (sum * scale + .grad) / divisor.

        Buffered parameters get the merged result cast to their own dtype (the dtype the inner
        optimizer expects); the others are divided in place. The current AMP loss scale is
        re-applied to the buffered sums, so ``.grad`` is in the units ``GradScaler.unscale_``
        expects. ``divisor`` None or 1: no division. Each sum is freed as soon as it is cast,
        so the sums and the window's gradient coexist for one parameter at a time. ``grads``:
        the parameters' ``.grad`` as just read by the caller (aligned with ``params``), or None.
        """
        self.folding = False  # the window's gradient is formed: autograd must not move it
        self._forget_order()
        if not self.sums:  # everything is in .grad: at most one division
            if divisor is not None and divisor != 1:
                present = _grads.grads_of(params) if grads is None else _grads.present(grads)
                _grads.div_(present, divisor)
            return
        scale = self.loss_scale()
        with torch.no_grad():
            divide: list[Tensor] = []
            merged: list[tuple[Tensor, Tensor]] = []
            into: list[Tensor] = []
            last: list[Tensor] = []  # the closing micro-step's gradients, still in .grad
            for p in params:
                held, g = self.sums.pop(p, None), p.grad
                if held is None:
                    if g is not None:
                        divide.append(g)
                    continue
                if scale is not None:
                    held.mul_(scale.to(held.device))
                if g is not None:
                    into.append(held)
                    last.append(g)
                divide.append(held)
                merged.append((p, held))
            self.sums.clear()
            if into:
                torch._foreach_add_(into, last)  # type promotion: bf16 into float32 sums
                last.clear()
            if divisor is not None and divisor != 1:
                _grads.div_(divide, divisor)
            divide.clear()
            while merged:
                p, total = merged.pop()
                p.grad = total if total.dtype == p.dtype else total.to(p.dtype)

    def unscale_closed(self, params: list[Tensor]) -> None:
        """Unscale the closed window's gradient by the current loss scale (``flush()`` outside
        ``scaler.step``), remembering any inf/NaN."""
        scale = self.loss_scale()
        if scale is not None and not self.unscaled:
            self.note_found_inf(_grads.unscale_(_grads.grads_of(params), scale))
            self.unscaled = True

    def finalize(self, params: list[Tensor], max_grad_norm: float | None) -> None:
        """Clip the closed window's (unscaled) gradient, once, keeping its pre-clip norm in
        :attr:`grad_norm`: a retried step after the inner optimizer's step() raised finds it
        ready and does not clip or unscale it again."""
        if not self.final and max_grad_norm is not None:
            self.grad_norm = _grads.clip_(params, max_grad_norm)
        self.final = True

    def skip_window(self, params: list[Tensor], check_finite: bool) -> bool:
        """Whether the closed window must be skipped for an inf/NaN: one seen under AMP, or,
        with ``check_finite`` (``nonfinite="skip_window"``), one in its gradient now."""
        if self.found_inf is not None:
            return bool(self.found_inf.item() > 0)
        return check_finite and not _grads.all_finite(_grads.grads_of(params))

    # ------------------------------------------------------------------ folding

    def fold(self, params: list[Tensor], scale: Tensor | None) -> None:
        """Add each parameter's ``.grad`` (divided by ``scale``) into its sum, then release
        ``.grad`` (the first time it becomes the sum, without a copy when the dtypes agree):
        the next backward pass hands its gradient over to ``.grad`` without an addition.

        Args:
            params: parameters whose gradient is folded; those without ``.grad`` are skipped.
            scale: the AMP loss scale the gradients were computed under (0-dim tensor), or None.
        """
        if not params:  # the common fp32 case: nothing to do, not even a no_grad scope
            return
        with torch.no_grad():
            if scale is None and params is self._order:  # the window's later micro-steps
                grads = list(map(_GRAD, params))
                if all(map(is_not, grads, _NONES)):  # each has a gradient and a sum: one add
                    torch._foreach_add_(self._order_sums, grads)
                    for p in params:
                        p.grad = None
                    return
                if not any(map(is_not, grads, _NONES)):  # the fold hooks took them all
                    return
            self._fold(params, scale)

    def _forget_order(self) -> None:
        """No list of sums aligned with the parameters (none holds a sum from now on)."""
        self._order: list[Tensor] | None = None
        self._order_sums: list[Tensor] = []

    def _fold(self, params: list[Tensor], scale: Tensor | None) -> None:
        """:meth:`fold` parameter by parameter; each ``.grad`` is released as soon as it was
        taken (a cast sum and its low-precision gradient coexist for one parameter at a
        time); then the sums are listed in ``params`` order for the next fold, if all exist."""
        fresh: list[tuple[Tensor, Tensor]] = []
        held: list[Tensor] = []
        incoming: list[Tensor] = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            p.grad = None
            total = self.sums.get(p)
            if total is None:
                target = buffer_dtype(p)
                # cast before unscaling: a scaled fp16 value / scale may underflow
                fresh.append((p, g if g.dtype == target else g.to(target)))
            else:
                held.append(total)
                incoming.append(g)
        if scale is not None:
            _grads.div_([g for _, g in fresh] + incoming, scale)
        if held:
            torch._foreach_add_(held, incoming)  # type promotion: bf16 into float32 sums
        self.sums.update(fresh)  # the fresh tensors are stolen: no copy without a cast
        order = [self.sums.get(p) for p in params]
        if all(map(is_not, order, _NONES)):
            self._order, self._order_sums = params, order  # type: ignore[assignment]

    # ------------------------------------------------------------------ checkpoints

    def contents(self, params: list[Tensor]) -> dict[str, Any]:
        """The buffer's part of a mid-window checkpoint (sums by parameter index)."""
        return {
            "buffer": {i: self.sums[p] for i, p in enumerate(params) if p in self.sums},
            "buffer_all": self.buffer_all,
            "found_inf": self.found_inf,
            "unfolded": self.unfolded,
        }

    def restore(self, window: dict[str, Any], params: list[Tensor]) -> None:
        """Load :meth:`contents` (copied onto each parameter's device); under rollback the
        finished micro-steps restored into ``.grad`` are folded in, apart from the next one."""
        with torch.no_grad():
            for i, b in window["buffer"].items():
                self.sums[params[i]] = b.to(device=params[i].device, copy=True)
        routed = bool(window.get("buffer_all")) and self.policy is not False  # buffer=False: never
        self.buffer_all = self.buffer_all or routed
        self._buffered = None
        self.unfolded = int(window.get("unfolded", 0))
        found = window["found_inf"]
        self.found_inf = None if found is None else found.clone()
        self._forget_order()
        if not window["closed"]:  # the window has a finished micro-step
            if self.buffer_all and not self.unfolded:  # saved by a wrapper without rollback
                self.fold(params, None)
            self._start_folding(self.buffered_params(params))

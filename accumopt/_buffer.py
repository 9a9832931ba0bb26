"""Where the finished micro-steps of the open window live: ``.grad``, or the window buffer's
per-parameter sums, for AMP (each micro-step unscaled with its own loss scale), bf16/fp16
gradients (summed in float32, folded as autograd accumulates them: about 2x the parameter bytes,
not 3x) and rollback (the micro-step in flight stays separable). At the boundary
:meth:`WindowBuffer.close` merges both into the window's gradient in ``.grad``."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

import torch
from torch import Tensor
from torch.amp import GradScaler
from torch.utils.hooks import RemovableHandle

from accumopt import _grads
from accumopt._counting import distributed, remove_all

_LOW_PRECISION = frozenset((torch.bfloat16, torch.float16))
_DTYPE = attrgetter("dtype")
_NONES = repeat(None)
_CHUNK = 1 << 20  # elements per piece of a CPU float32 += bf16 add: torch promotes a 4 MiB copy


class WindowBuffer:
    """The finished micro-steps of the open window that do not live in ``.grad``: ``policy`` is
    the wrapper's ``buffer`` (None: bf16/fp16 parameters only; True: all; False: none);
    ``buffer_all`` routes every parameter through it (rollback).

    Attributes:
        sums: parameter -> the sum of its folded, unscaled gradients (at least float32).
        unfolded: counted micro-steps whose scaled gradient waits in ``.grad`` for scaler.step.
        folding: low-precision gradients are folded as autograd accumulates them.
    """

    def __init__(self, policy: bool | None, buffer_all: bool, scaler: GradScaler | None) -> None:
        self.policy, self.buffer_all, self.scaler = policy, buffer_all, scaler
        self.sums: dict[Tensor, Tensor] = {}
        self._own_hook()
        self.reset()

    def _own_hook(self) -> None:
        """Own a fold hook that holds the buffer weakly (the parameters hold the hook)."""
        ref = weakref.ref(self)

        def hook(param: Tensor) -> None:
            buffer = ref()
            if buffer is not None:
                buffer.fold_accumulated(param)

        self._handles: list[RemovableHandle] = []
        self._hook = hook
        weakref.finalize(self, remove_all, self._handles)

    def reset(self) -> None:
        """Forget the window (a new one opens)."""
        self._buffered: list[Tensor] | None = None  # listed again each window: dtypes change
        self.sums.clear()
        self.unfolded, self.folding = 0, False
        self._order: list[Tensor] | None = None  # the parameters of the sums in _order_sums
        self._order_sums: list[Tensor] = []

    def __getstate__(self) -> dict[str, Any]:
        """A copy keeps the sums, not the hooks (they live on the original's parameters)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_handles", "_hook")}
        return {**state, "folding": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._own_hook()

    def loss_scale(self) -> Tensor | None:
        """The scaler's current loss scale (0-dim tensor, no host sync), or None."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return self.scaler._get_scale_async()

    def buffered_params(self, params: list[Tensor]) -> list[Tensor]:
        """The parameters whose micro-steps go to the buffer (listed once a window)."""
        if self._buffered is None:
            if self.buffer_all and self.policy is not False:
                self._buffered = params
            elif self.policy is False or _LOW_PRECISION.isdisjoint(map(_DTYPE, params)):
                self._buffered = []
            else:
                self._buffered = [p for p in params if p.dtype in _LOW_PRECISION]
        return self._buffered

    def forget_params(self) -> None:
        """The parameters changed (a group was added, a checkpoint loaded): list again."""
        self._buffered = None

    def grad_only(self, params: list[Tensor]) -> bool:
        """Whether every finished micro-step stays in ``.grad`` (DDP may sync the closing one)."""
        return not self.buffered_params(params) and self.loss_scale() is None

    def micro_step_done(self, params_of: Callable[[], list[Tensor]]) -> None:
        """A micro-step that does not close the window was counted: fold it (AMP: not yet)."""
        if self.loss_scale() is not None:
            self.unfolded += 1
        elif self._buffered != []:  # the common fp32 case: nothing to fold, nothing to list
            params = self.buffered_params(params_of())
            if params:
                self.fold(params, None)
                self._start_folding(params)

    def _start_folding(self, params: list[Tensor]) -> None:
        """Fold the next micro-steps' low-precision gradients as autograd accumulates them (not
        the first: the noise scale reads it in ``.grad``), unless the micro-step in flight must
        stay separable (rollback, AMP, a process group)."""
        if self.folding:
            return
        # under a process group, DDP/FSDP2 would reduce a .grad folded away as zeros
        if self.policy is not None or self.buffer_all or self.scaler is not None or distributed():
            remove_all(self._handles)
            return
        for p in params:
            hooks = p._post_accumulate_grad_hooks
            if p.requires_grad and (hooks is None or self._hook not in hooks.values()):
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))  # type: ignore[no-untyped-call]
        self.folding = True

    def fold_accumulated(self, param: Tensor) -> None:
        """Post-accumulate-grad hook: while folding, move a dense ``param.grad`` into its sum."""
        grad = param.grad
        if not self.folding or param.dtype not in _LOW_PRECISION or grad is None or grad.is_sparse:
            return
        with torch.no_grad():
            total = self.sums.get(param)
            if total is None:
                self.sums[param] = grad.to(torch.promote_types(param.dtype, torch.float32))
            else:
                _add_promoted(total, grad)
        param.grad = None

    def fold_scaled(self, params: list[Tensor], grad_scale: Tensor | None) -> None:
        """``scaler.step(opt)`` inside the window: fold every parameter, unscaled."""
        self.fold(params, grad_scale)
        self.unfolded = 0

    def separable(self, micro_step: int) -> bool:
        """Whether the micro-step in flight can be dropped alone (no finished one in ``.grad``)."""
        return not self.unfolded and (micro_step == 0 or self.buffer_all)

    def route_all(self, params: list[Tensor], micro_step: int) -> None:
        """Route every parameter through the buffer from now on (rollback), folding what the
        window holds in ``.grad`` first, unless it waits there for ``scaler.step``."""
        if self.buffer_all:
            return
        self.buffer_all, self._buffered, self.folding = True, None, False
        remove_all(self._handles)
        if micro_step and not self.unfolded:
            self.fold(params, None)

    def close(self, params: list[Tensor], divisor: float | None) -> None:
        """Write (sum * loss scale + .grad) / divisor into ``.grad`` in each parameter's dtype (in
        the units ``GradScaler.unscale_`` expects; ``divisor`` None or 1: no division)."""
        self.folding, self._order, self._order_sums = False, None, []
        if not self.sums:  # everything is in .grad: at most one division
            if divisor is not None and divisor != 1:
                _grads.div_(_grads.grads_of(params), divisor)
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

    @torch.no_grad()
    def fold(self, params: list[Tensor], scale: Tensor | None) -> None:
        """Add each parameter's ``.grad`` (divided by ``scale``) into its sum and release
        ``.grad`` (the first time it becomes the sum, without a copy when the dtypes agree)."""
        if not params:
            return
        if scale is None and params is self._order:  # the window's later micro-steps
            grads = list(map(attrgetter("grad"), params))
            if all(map(is_not, grads, _NONES)):  # each has a gradient and a sum: one add
                torch._foreach_add_(self._order_sums, grads)
                for p in params:
                    p.grad = None
                return
            if not any(map(is_not, grads, _NONES)):  # the fold hooks took them all
                return
        # parameter by parameter: a cast sum and its low-precision gradient coexist for one
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
                target = torch.promote_types(p.dtype, torch.float32)
                # cast before unscaling: a scaled fp16 value / scale may underflow
                fresh.append((p, g if g.dtype == target else g.to(target)))
            else:
                held.append(total)
                incoming.append(g)
        if scale is not None:
            _grads.div_([g for _, g in fresh] + incoming, scale)
        if held:
            torch._foreach_add_(held, incoming)
        self.sums.update(fresh)
        order = [self.sums.get(p) for p in params]
        if all(map(is_not, order, _NONES)):
            self._order, self._order_sums = params, order  # type: ignore[assignment]

    def restore(self, saved: dict[str, Any], params: list[Tensor], closed: bool) -> None:
        """Load a checkpoint's ``sums`` (by parameter index, copied onto each parameter's
        device), ``buffer_all`` and ``unfolded``."""
        with torch.no_grad():
            for i, b in saved["sums"].items():
                self.sums[params[i]] = b.to(device=params[i].device, copy=True)
        self.buffer_all = self.buffer_all or (saved["buffer_all"] and self.policy is not False)
        self._buffered = None
        self.unfolded = saved["unfolded"]
        if not closed:  # the window has a finished micro-step
            if self.buffer_all and not self.unfolded:  # saved without rollback
                self.fold(params, None)
            self._start_folding(self.buffered_params(params))


def _add_promoted(total: Tensor, grad: Tensor) -> None:
    """``total += grad`` (float32/64 += bf16/fp16), in ``_CHUNK`` pieces on the CPU."""
    if grad.is_cpu and grad.numel() > _CHUNK and total.is_contiguous() and grad.is_contiguous():
        pieces = zip(torch.split(total.view(-1), _CHUNK), torch.split(grad.view(-1), _CHUNK))
        for into, piece in pieces:
            into.add_(piece)
    else:
        total.add_(grad)

"""The window buffer: finished micro-steps' gradients, kept apart from ``.grad``.

Three jobs share one mechanism. Moving a micro-step's gradient out of ``.grad`` into the buffer
right after it is complete

- lets each micro-step be unscaled with its own AMP loss scale (a scale change inside a window
  cannot mix two scales);
- keeps low-precision (bf16/fp16) gradients in a float32 sum, so the rounding error of the sum
  does not grow with the number of micro-steps (DeepSpeed's ``BF16_Optimizer`` and Megatron's
  ``main_grad`` do this inside their engines);
- makes the micro-step in flight separable: after an out-of-memory error or a non-finite
  gradient, dropping ``.grad`` removes that micro-step alone and keeps every finished one.

Memory: one buffer tensor per buffered parameter, in ``promote_types(param dtype, float32)``
(4 bytes per element for bf16/fp16/fp32 parameters, 8 for float64); ``.grad`` exists only
during a backward pass and until the micro-step is folded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from accumopt import _grads


def buffer_dtype(param: Tensor) -> torch.dtype:
    """The dtype a parameter's gradient is summed in: at least float32."""
    return torch.promote_types(param.dtype, torch.float32)


class WindowBuffer:
    """Per-parameter sums of the folded micro-steps of the open window (unscaled)."""

    def __init__(self) -> None:
        self.sums: dict[Tensor, Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.sums)

    def clear(self) -> None:
        self.sums.clear()

    def fold(self, params: list[Tensor], scale: Tensor | None) -> None:
        """Add each parameter's ``.grad`` (divided by ``scale``) into its sum; release ``.grad``.

        Args:
            params: parameters whose gradient is folded; those without ``.grad`` are skipped.
            scale: the AMP loss scale the gradients were computed under (0-dim tensor), or None.
        """
        if not params:  # the common fp32 case: nothing to do, not even a no_grad scope
            return
        with torch.no_grad():
            self._fold(params, scale)

    def _fold(self, params: list[Tensor], scale: Tensor | None) -> None:
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

    @torch.no_grad()
    def close(self, params: list[Tensor], scale: Tensor | None, divisor: float | None) -> None:
        """Write the window's gradient into ``.grad``: (sum * scale + .grad) / divisor.

        Buffered parameters get the merged result cast to their own dtype (the dtype the inner
        optimizer expects); the others are divided in place. ``scale`` re-applies the current
        AMP loss scale, so ``.grad`` is in the units ``GradScaler.unscale_`` expects.
        """
        divide: list[Tensor] = []
        merged: list[tuple[Tensor, Tensor]] = []
        for p in params:
            held = self.sums.pop(p, None)
            if held is None:
                if p.grad is not None:
                    divide.append(p.grad)
                continue
            if scale is not None:
                held.mul_(scale.to(held.device))
            if p.grad is not None:
                held.add_(p.grad)
            divide.append(held)
            merged.append((p, held))
        self.sums.clear()
        if divisor is not None and divisor != 1:
            _grads.div_(divide, divisor)
        for p, total in merged:
            p.grad = total if total.dtype == p.dtype else total.to(p.dtype)

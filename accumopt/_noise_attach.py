"""How the gradient noise scale (:class:`accumopt.noise.NoiseScale`) is switched on for a
wrapper: its two hooks are mixed into the class of the wrapper's sync object (``LocalSync`` or
``GradSync``), so that they run at the window's first micro-step and at its boundary only, and
nothing runs when the estimate is off."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from torch import Tensor

from accumopt import _grads
from accumopt.noise import NoiseScale

if TYPE_CHECKING:
    from accumopt._window import Window
    from accumopt._window_buffer import WindowBuffer
    from accumopt.accumulate import AccumulatingOptimizer


class _NoiseHooks:
    """Mixed into the wrapper's sync object's class (``LocalSync``/``GradSync``) when the
    estimate is on: the hooks run at the first micro-step and at the boundary only; with the
    estimate off nothing is mixed in and nothing runs."""

    noise_scale: NoiseScale

    def counted(self, items: float | None, window: Window) -> float | None:
        if window.micro_step == 0:
            synced = bool(getattr(self, "enabled", False))  # DDP synchronises this pass
            self.noise_scale._first_micro_step(items, synced)
        return super().counted(items, window)  # type: ignore[misc, no-any-return]

    def close(
        self, buffer: WindowBuffer, params: list[Tensor], divisor: float | None, grads: Any
    ) -> None:
        # the .grad tensors read before the close are the window's gradient where no buffered
        # sum replaces them (each divided in place)
        held = None if grads is None or buffer else _grads.present(grads)
        super().close(buffer, params, divisor, grads)  # type: ignore[misc]
        opt = self.noise_scale._opt() if self.noise_scale._opt is not None else None
        if opt is not None:
            self.noise_scale._window_closed(self, opt._window, buffer, params, held)


_MIXED: dict[type, type] = {}


def attach(opt: AccumulatingOptimizer, noise_scale: object) -> NoiseScale | None:
    """Turn the estimate on for ``opt`` (``noise_scale``: False/None, True, or a
    :class:`NoiseScale`); a schedule that needs it (``schedules.AdaptiveBatch``) turns it on
    and is bound to it. Returns the estimator, or None when off.

    Raises:
        TypeError: ``noise_scale`` is none of these.
        ValueError: an FSDP2 model, or ``reduce_every_micro_step=True`` (no per-rank
            gradient of the first micro-step to measure).
    """
    schedule = opt._window.schedule
    wants = callable(getattr(schedule, "bind_noise_scale", None))
    if noise_scale is None or noise_scale is False:
        if not wants:
            return None
        noise_scale = True
    if noise_scale is True:
        noise_scale = NoiseScale()
    if not isinstance(noise_scale, NoiseScale):
        raise TypeError(
            f"Accumulate: noise_scale={noise_scale!r} is not supported; expected True, False "
            "or an accumopt.noise.NoiseScale (e.g. NoiseScale(decay=0.9))."
        )
    sync = opt._sync
    if sync.fsdp or opt.reduce_every_micro_step:
        raise ValueError(
            "Accumulate: noise_scale with an FSDP2 model or reduce_every_micro_step=True is not "
            "supported; expected a single process or DDP with one sync per update (the estimate "
            "needs each rank's own gradient of a window's first micro-step)."
        )
    base = type(sync)
    mixed = _MIXED.get(base)
    if mixed is None:
        mixed = _MIXED[base] = type(f"Noise{base.__name__}", (_NoiseHooks, base), {})
    sync.__class__ = mixed
    sync.noise_scale = noise_scale  # type: ignore[union-attr]
    noise_scale._opt = weakref.ref(opt)
    if wants:
        schedule.bind_noise_scale(noise_scale, opt._window.in_items)  # type: ignore[union-attr]
    return noise_scale

"""The gradient noise scale, online, from gradients an accumulation window already holds.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162), App. A.1: the *simple noise scale* ``B_simple = tr(Σ) / |G|²`` (``G`` the
true gradient, ``Σ`` the per-item gradient covariance) predicts the critical batch size. With
``B`` i.i.d. items, ``E|G_B|² = |G|² + tr(Σ)/B``, so the squared norms of two gradients of the
same weights at two batch sizes ``B_small < B_big`` give unbiased estimates of both parts::

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

A window holds both for free: ``G_small`` is the gradient of its **first micro-step**, read in
``.grad`` at the end of that backward pass (before the second one adds into it), and ``G_big``
is the window's gradient at the boundary. Under DDP ``G_small`` is each rank's own first
micro-step (unsynchronised), averaged over the ranks with one 3-element all-reduce per update,
and ``G_big`` the all-reduced window. ``B`` is in items for weighted windows
(``opt.backward(loss_sum, items=n)``) and in micro-batches (over all ranks) for plain
``loss.backward()`` of mean losses: multiply by your micro-batch size to get samples.

Each part is smoothed separately with an exponential moving average (bias-corrected, so its
first values are not pulled toward 0), and the noise scale is the ratio of the two averages,
as in the paper. Cost: two squared-norm passes over the gradients per measured window (one at
the first micro-step, one at the boundary; ``accumopt._squares``), no host sync inside the
window: a window's norms are read (one ``tolist``) when the next window closes, or when a
value is asked for.

Assumptions and known bias:

- The items of a window are i.i.d. draws and the weights do not move within it (one update).
  Items correlated within a micro-batch (one sequence's tokens) make ``tr(Σ)`` per token too
  small; sampling a small dataset without replacement shrinks both (finite population).
- The ratio of two unbiased averages is biased (``E[a]/E[b] != E[a/b]``); the ratio of the
  averages (not the average of per-window ratios, which explodes when one ``|G|²`` is near 0)
  keeps it small over enough windows, which mix recent weights (``decay``).
- A window of one micro-step has one batch size only and adds nothing (except under DDP with
  accumopt's own boundary all-reduce, where each rank's share is the small batch). A first
  micro-step DDP synchronised itself (``every=1``) adds nothing either.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from accumopt import _grads
from accumopt._checks import positive_int
from accumopt._squares import SquaredNorm

if TYPE_CHECKING:
    from accumopt._window import Window
    from accumopt._window_buffer import WindowBuffer
    from accumopt.accumulate import AccumulatingOptimizer


class NoiseScale:
    """The online estimate of the gradient noise scale ``B_simple = tr(Σ)/|G|²``.

    Build the wrapper with ``noise_scale=True`` (or ``noise_scale=NoiseScale(decay=...)``) and
    read ``opt.noise_scale.value`` at any time (``float(opt.noise_scale)`` too)::

        opt = Accumulate(torch.optim.AdamW(model.parameters()), every=8, noise_scale=True)
        ...
        if opt.did_update:
            print(opt.noise_scale.value, opt.noise_scale.trace_sigma, opt.noise_scale.grad_sq)

    Args:
        decay: the EMA decay per measured window, in [0, 1); None: the plain mean over all
            windows.
        every_windows: which windows are measured. None (default): one per
            ``MIN_MICRO_STEPS`` (16) micro-steps counted since the last measured window began
            (every window of 16 micro-steps or more, one in ``ceil(16 / k)`` of k, the first
            always); an int >= 1: one window in this many. A measured window costs two
            squared-norm passes over the gradients (fused on a GPU; on a CPU 0.1-0.2 ms per
            window on 100 small tensors), an unmeasured one nothing: the default keeps the cost
            under 1 % per micro-step even on ``bench/``'s cheapest model (2-3 % measuring every
            window of 4 micro-steps: ``bench/bench_noise_scale.py``). The decay applies per
            measured window. Under DDP every rank measures the same windows.

    Attributes:
        windows (int): windows that gave an estimate (property).
        last (tuple[float, float] | None): the last window's unsmoothed ``(tr(Σ), |G|²)``
            (property).
        batch_per_micro_step (float | None): the last window's batch (items, or micro-batches
            over all ranks) per micro-step.
    """

    MIN_MICRO_STEPS = 16  # every_windows=None: micro-steps from one measured window to the next

    def __init__(self, decay: float | None = 0.95, every_windows: int | None = None) -> None:
        if decay is not None and not (isinstance(decay, float | int) and 0 <= decay < 1):
            raise ValueError(
                f"NoiseScale: decay={decay!r} is not in [0, 1); expected the EMA decay per "
                "window (e.g. 0.95), or None for the plain mean over all windows."
            )
        if every_windows is not None and not positive_int(every_windows):
            raise ValueError(
                f"NoiseScale: every_windows={every_windows!r} is not an int >= 1 or None; "
                "expected how many windows make one measured window (1: every window), or None "
                f"(one window per {self.MIN_MICRO_STEPS} micro-steps at most)."
            )
        self.decay, self.every_windows = decay, every_windows
        self._seen = 0  # windows closed so far: window i is measured when i % every_windows == 0
        self._since = self.MIN_MICRO_STEPS  # None: micro-steps since the last measured began
        self._windows = 0
        self._last: tuple[float, float] | None = None
        self._per_step: float | None = None  # batch_per_micro_step
        self._sums = [0.0, 0.0, 0.0]  # weighted sums of tr(Σ), |G|², and of the weights
        self._small: tuple[Tensor, float] | None = None  # B_small² |G_small|², B_small
        # the open window is measured and its first micro-step was this rank's own (not
        # synchronised by DDP): the same on every rank, unlike _small (a rank with no items)
        self._first = False
        # a closed window, unread: ((squared norms, CUDA event), host factors to |G_small|²,
        # 1/B_small, |G_big|² (None: DDP's four all-reduced values), 1/B_big, B per micro-step)
        self._pending: (
            tuple[tuple[Tensor, Any], tuple[float, float, float] | None, float, float] | None
        ) = None
        self._squares = SquaredNorm()  # sum |g|², planned for the model's gradients
        self._opt: weakref.ref[AccumulatingOptimizer] | None = None

    # ------------------------------------------------------------------ reading

    @property
    def windows(self) -> int:
        """Windows that gave an estimate so far."""
        self._read()
        return self._windows

    @property
    def last(self) -> tuple[float, float] | None:
        """The last window's unsmoothed ``(tr(Σ), |G|²)`` (None before the first estimate)."""
        self._read()
        return self._last

    @property
    def batch_per_micro_step(self) -> float | None:
        """The last window's batch per micro-step (items, or micro-batches over all ranks)."""
        self._read()
        return self._per_step

    @property
    def trace_sigma(self) -> float | None:
        """The smoothed ``tr(Σ)`` (per item; None before the first estimate)."""
        self._read()
        return self._sums[0] / self._sums[2] if self._sums[2] else None

    @property
    def grad_sq(self) -> float | None:
        """The smoothed ``|G|²`` (None before the first estimate)."""
        self._read()
        return self._sums[1] / self._sums[2] if self._sums[2] else None

    @property
    def value(self) -> float | None:
        """``B_simple = tr(Σ)/|G|²`` from the smoothed parts: None before the first estimate,
        ``inf`` while the smoothed ``|G|²`` is <= 0 (noise dominates)."""
        trace, grad = self.trace_sigma, self.grad_sq
        if trace is None or grad is None:
            return None
        return trace / grad if grad > 0 else math.inf

    def __float__(self) -> float:
        value = self.value
        return math.nan if value is None else value

    def __repr__(self) -> str:
        return (
            f"NoiseScale(decay={self.decay!r}, every_windows={self.every_windows}, "
            f"value={self.value!r}, windows={self.windows})"
        )

    def _read(self) -> None:
        """Fold the closed window's norms into the averages (one host sync)."""
        if self._pending is None:
            return
        (values, done), factors, inv_big, per_step = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        if factors is None:  # DDP: the ranks' small-batch parts summed, and |G_big|²
            small_sum, inv_small_sum, ranks, big = values.tolist()
            if ranks <= 0:
                return
            small, inv_small = small_sum / ranks, inv_small_sum / ranks
        else:
            (small_sq, big_sq), (small_factor, inv_small, big_factor) = values.tolist(), factors
            small, big = small_sq * small_factor, big_sq * big_factor
        gap = inv_small - inv_big
        if not (gap > 0 and math.isfinite(small) and math.isfinite(big)):
            return  # one batch size only, or an inf/NaN (a window AMP skips)
        trace, grad = (small - big) / gap, (big * inv_small - small * inv_big) / gap
        beta = 1.0 if self.decay is None else self.decay
        sums = self._sums
        self._sums = [beta * sums[0] + trace, beta * sums[1] + grad, beta * sums[2] + 1.0]
        self._windows += 1
        self._last, self._per_step = (trace, grad), per_step

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The averages (plain floats; the last window folded in)."""
        self._read()
        return {
            "decay": self.decay,
            "windows": self.windows,
            "sums": list(self._sums),
            "last": self.last,
            "batch_per_micro_step": self.batch_per_micro_step,
            "every_windows": self.every_windows,
            "seen": self._seen,
            "since": self._since,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the averages of :meth:`state_dict` (:meth:`read_state`'s ValueError)."""
        self.__dict__.update(self.read_state(state))

    def read_state(self, state: Any) -> dict[str, Any]:
        """The attributes :meth:`load_state_dict` sets from ``state``; ValueError where a field
        is missing or of the wrong type."""
        try:
            every, last, sums = state.get("every_windows"), state["last"], state["sums"]
            parsed = {
                "decay": state["decay"] if state["decay"] is None else float(state["decay"]),
                "_windows": int(state["windows"]),
                "_sums": [float(sums[0]), float(sums[1]), float(sums[2])],
                "_last": None if last is None else (float(last[0]), float(last[1])),
                "_per_step": state["batch_per_micro_step"],
                "every_windows": None if every is None else int(every),
                "_seen": int(state.get("seen", 0)),
                "_since": int(state.get("since", self.MIN_MICRO_STEPS)),
                "_pending": None,
                "_small": None,
                "_first": False,
            }
            decay, per_step = parsed["decay"], parsed["_per_step"]
            in_range = {
                "decay": decay is None or 0 <= decay < 1,
                "windows, seen, since": min(parsed["_windows"], parsed["_seen"], parsed["_since"])
                >= 0,
                "every_windows": every is None or parsed["every_windows"] >= 1,
                "batch_per_micro_step": per_step is None
                or (isinstance(per_step, float | int) and math.isfinite(per_step) and per_step > 0),
            }
            bad = [name for name, ok in in_range.items() if not ok]
            if bad:
                raise ValueError(f"{', '.join(bad)} out of range")
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"NoiseScale.load_state_dict: a damaged state ({type(err).__name__}: {err}); "
                "expected the dict of state_dict(). Nothing was changed."
            ) from None
        return parsed

    def __getstate__(self) -> dict[str, Any]:
        self._read()
        return {
            **self.__dict__,
            "_opt": None,
            "_small": None,
            "_first": False,
            "_squares": SquaredNorm(),
        }

    # ------------------------------------------------------------------ the window's hooks

    def _first_micro_step(self, items: float | None, synced: bool) -> None:
        """The window's first micro-step is in ``.grad``: keep its squared norm (a tensor)."""
        self._small, self._first = None, False
        opt = self._opt() if self._opt is not None else None
        if opt is None or not self._measures() or synced:
            return
        self._first = True
        if items is not None and items <= 0:
            return
        grads = _grads.grads_of(opt._window_params())
        if grads:
            n = 1.0 if items is None else float(items)
            self._small = (self._squares(grads, opt._buffer.loss_scale()), n)

    def _measures(self) -> bool:
        """Whether the window now open is measured (the same answer all window long)."""
        if self.every_windows is None:
            return self._since >= self.MIN_MICRO_STEPS
        return self._seen % self.every_windows == 0

    def _window_closed(
        self,
        sync: Any,
        window: Window,
        buffer: WindowBuffer,
        params: list[Tensor],
        held: list[Tensor] | None,
    ) -> None:
        """The window's gradient is in ``.grad`` (``held``: its tensors, or None to read them):
        keep both squared norms (no host sync), read the previous window's."""
        self._read()
        small, first, self._small, self._first = self._small, self._first, None, False
        world = int(getattr(sync, "world_size", 1))
        # measured where there is a first micro-step to estimate from: in one process its
        # norm; under DDP one of each rank's own, alike on every rank (a window whose first
        # micro-step DDP synchronised, after a flush, or one resumed inside: not measured,
        # and the next one is due)
        measured = self._measures() and (small is not None if world == 1 else first)
        self._seen += 1
        self._since = window.micro_step if measured else self._since + window.micro_step
        if not measured:
            return
        big_batch = window.items if window.weighted else float(window.micro_step * world)
        grads = _grads.grads_of(params) if held is None else held
        if big_batch <= 0 or not grads:
            return
        big = self._squares(grads, buffer.loss_scale())
        # .grad holds the sum for reduction="sum": the mean is / big_batch
        big_factor = 1.0 / (big_batch * big_batch) if window.reduction == "sum" else 1.0
        inv_big, per_step = 1.0 / big_batch, big_batch / window.micro_step
        if small is not None and world == 1:
            values = torch.stack([small[0].to(big), big])
            factors = (1.0 / (small[1] * small[1]), 1.0 / small[1], big_factor)
            self._pending = (_to_host(values), factors, inv_big, per_step)
            return
        if small is None:  # this rank has no small batch: it counts as 0 ranks
            part, inv_small, count = torch.zeros_like(big), 0.0, 0.0
        else:
            part, inv_small, count = small[0].to(big) / (small[1] * small[1]), 1.0 / small[1], 1.0
        rest = torch.tensor([inv_small, count], dtype=big.dtype, device=big.device)
        # the ranks' small-batch parts summed (big: the same on every rank), one all-reduce
        packed = torch.cat([part.reshape(1), rest, (big * (big_factor / world)).reshape(1)])
        sync.sum_grads([packed])
        self._pending = (_to_host(packed), None, inv_big, per_step)


def _to_host(packed: Tensor) -> tuple[Tensor, Any]:
    """Start copying ``packed`` to the host without waiting for it (CUDA: pinned memory and
    an event, waited for when the values are read, a window later)."""
    if packed.device.type != "cuda":
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    return host, done

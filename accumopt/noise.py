"""The gradient noise scale ``B_simple = tr(Σ)/|G|²`` (McCandlish et al. 2018, App. A.1), online:
as ``E|G_B|² = |G|² + tr(Σ)/B``, from the squared norms of a window's first micro-step's and the
whole window's gradients. docs/guide/schedules.md."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from accumopt._checks import positive_int

if TYPE_CHECKING:
    from accumopt.accumulate import Accumulate


class NoiseScale:
    """The online estimate of the gradient noise scale ``B_simple = tr(Σ)/|G|²``: build the
    wrapper with ``noise_scale=True`` (or ``=NoiseScale(...)``) and read ``opt.noise_scale.value``
    (``float(opt.noise_scale)``: NaN before the first estimate). ValueError for bad arguments.

    Args:
        decay: the EMA decay per measured window, in [0, 1); None: the plain mean.
        every_windows: None (default): a window is measured once ``MIN_MICRO_STEPS`` (16)
            micro-steps were counted since the last measured one began (the first window
            always), which keeps the cost under 1 %; an int >= 1: one window in this many.
    """

    MIN_MICRO_STEPS = 16

    def __init__(self, decay: float | None = 0.95, every_windows: int | None = None) -> None:
        real = isinstance(decay, float | int) and not isinstance(decay, bool)
        if decay is not None and not (real and 0 <= decay < 1):
            raise ValueError(
                f"NoiseScale: decay={decay!r} is not in [0, 1); expected the EMA decay per "
                "window (e.g. 0.95), or None for the plain mean over all windows."
            )
        if every_windows is not None and not positive_int(every_windows):
            raise ValueError(
                f"NoiseScale: every_windows={every_windows!r} is not an int >= 1; expected how "
                "many windows make one measured window (1: every window), or None."
            )
        self.decay, self.every_windows = decay, every_windows
        self._seen, self._windows = 0, 0  # windows closed so far, and those that gave estimates
        self._since = self.MIN_MICRO_STEPS  # micro-steps since the last measured window began
        self._last: tuple[float, float] | None = None
        self._per_step: float | None = None
        self._sums = [0.0, 0.0, 0.0]  # decayed sums of tr(Σ), |G|² and of the weights
        self._small: tuple[Tensor, float] | None = None  # |G_small|² (a tensor), B_small
        self._first = False  # the open window is measured and its first pass was unsynced
        # the closed window's norms on their way to the host, CUDA event, 1/B_big, B per step
        self._pending: tuple[Tensor, Any, float, float] | None = None
        self._squares = SquaredNorm()

    @property
    def windows(self) -> int:
        """Windows that gave an estimate so far."""
        self._read()
        return self._windows

    @property
    def last(self) -> tuple[float, float] | None:
        """The last window's unsmoothed ``(tr(Σ), |G|²)``; None before the first estimate."""
        self._read()
        return self._last

    @property
    def batch_per_micro_step(self) -> float | None:
        """The last window's batch per micro-step (items, or micro-batches over all ranks)."""
        self._read()
        return self._per_step

    @property
    def trace_sigma(self) -> float | None:
        """The smoothed ``tr(Σ)`` (per item); None before the first estimate."""
        self._read()
        return self._sums[0] / self._sums[2] if self._sums[2] else None

    @property
    def grad_sq(self) -> float | None:
        """The smoothed ``|G|²``; None before the first estimate."""
        self._read()
        return self._sums[1] / self._sums[2] if self._sums[2] else None

    @property
    def value(self) -> float | None:
        """``B_simple``; None before the first estimate, ``inf`` while ``grad_sq`` <= 0."""
        trace, grad = self.trace_sigma, self.grad_sq
        if trace is None or grad is None:
            return None
        return trace / grad if grad > 0 else math.inf

    def __float__(self) -> float:
        value = self.value
        return math.nan if value is None else value

    def __repr__(self) -> str:
        args = f"decay={self.decay!r}, every_windows={self.every_windows}"
        return f"NoiseScale({args}, value={self.value!r}, windows={self.windows})"

    def _read(self) -> None:
        """Fold the closed window's norms into the averages (one host sync)."""
        if self._pending is None:
            return
        (values, done, inv_big, per_step), self._pending = self._pending, None
        if done is not None:
            done.synchronize()
        small_sum, inv_small_sum, ranks, big = values.tolist()
        if ranks <= 0:
            return
        small, inv_small = small_sum / ranks, inv_small_sum / ranks
        gap = inv_small - inv_big
        if not (gap > 0 and math.isfinite(small) and math.isfinite(big)):
            return  # one batch size only, or an inf/NaN (a window AMP skips)
        # the paper's unbiased estimates, in 1/B: tr(Σ) = (small - big) / (1/B_small - 1/B_big)
        trace, grad = (small - big) / gap, (big * inv_small - small * inv_big) / gap
        beta = 1.0 if self.decay is None else self.decay
        self._sums = [beta * s + x for s, x in zip(self._sums, (trace, grad, 1.0))]
        self._windows += 1
        self._last, self._per_step = (trace, grad), per_step

    def state_dict(self) -> dict[str, Any]:
        """The averages and the measuring position, as plain numbers."""
        self._read()
        return {
            "decay": self.decay,
            "windows": self._windows,
            "sums": list(self._sums),
            "last": self._last,
            "batch_per_micro_step": self._per_step,
            "every_windows": self.every_windows,
            "seen": self._seen,
            "since": self._since,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume :meth:`state_dict` (ValueError as :meth:`read_state`, nothing changed)."""
        self.__dict__.update(self.read_state(state))

    def read_state(self, state: Any) -> dict[str, Any]:
        """The attributes :meth:`load_state_dict` sets from ``state``; ValueError if damaged."""
        try:
            fresh = NoiseScale(state["decay"], state.get("every_windows"))  # checks both
            fresh._windows, fresh._seen = int(state["windows"]), int(state.get("seen", 0))
            fresh._since = int(state.get("since", NoiseScale.MIN_MICRO_STEPS))
            fresh._sums = [float(state["sums"][i]) for i in range(3)]
            last, fresh._per_step = state["last"], state["batch_per_micro_step"]
            fresh._last = None if last is None else (float(last[0]), float(last[1]))
            per_step = 1.0 if fresh._per_step is None else fresh._per_step
            if min(fresh._windows, fresh._seen, fresh._since) < 0 or not (
                isinstance(per_step, float | int) and math.isfinite(per_step) and per_step > 0
            ):
                raise ValueError("windows, seen, since or batch_per_micro_step out of range")
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"NoiseScale.load_state_dict: a damaged state ({type(err).__name__}: {err}); "
                "expected the dict of state_dict(). Nothing was changed."
            ) from None
        return {k: v for k, v in fresh.__dict__.items() if k != "_squares"}

    def __getstate__(self) -> dict[str, Any]:  # a copy starts without the open window's norm
        self._read()
        return {**self.__dict__, "_small": None, "_first": False}

    def attach(self, opt: Accumulate) -> None:
        """Measure ``opt``'s windows from now on (through its hooks); ValueError where ``opt`` has
        ``reduce_every_micro_step=True`` (no rank has a first micro-step of its own)."""
        if opt.reduce_every_micro_step:
            raise ValueError(
                "Accumulate: noise_scale with reduce_every_micro_step=True is not supported; "
                "expected one sync per update (each rank's own first micro-step is measured)."
            )
        opt.register_micro_step_hook(self._micro_step)
        opt.register_window_hook(self._window_closed)

    def _measures(self) -> bool:
        """Whether the open window is measured (the same answer all window long)."""
        if self.every_windows is None:
            return self._since >= self.MIN_MICRO_STEPS
        return self._seen % self.every_windows == 0

    def _micro_step(self, opt: Accumulate, items: float | None, synced: bool) -> None:
        """At a window's first micro-step (its gradient in ``.grad``): keep its squared norm."""
        if opt.micro_step != 1:
            return
        self._small, self._first = None, self._measures() and not synced
        if self._first and (items is None or items > 0):
            small = self._squared_norm(opt)
            if small is not None:
                self._small = (small, 1.0 if items is None else items)

    def _squared_norm(self, opt: Accumulate) -> Tensor | None:
        """``|.grad|²`` of ``opt``'s parameters (AMP's loss scale divided out); None if none."""
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        scaler = opt.scaler
        scale = scaler._get_scale_async() if scaler is not None and scaler.is_enabled() else None
        return self._squares(grads, scale) if grads else None

    def _window_closed(self, opt: Accumulate) -> None:
        """The window's gradient is in ``.grad``: start its norms' way to the host (one DDP
        all-reduce of [sum over ranks of |G_small|²/B_small² and of 1/B_small, ranks, |G_big|²])."""
        self._read()
        small, first, self._small, self._first = self._small, self._first, None, False
        world, micro_steps = opt.world_size, opt.micro_step
        # under DDP: where every rank had a first pass of its own (a rank may have no items)
        measured = self._measures() and (small is not None if world == 1 else first)
        self._seen += 1
        self._since = micro_steps if measured else self._since + micro_steps
        if not measured:
            return
        big_batch = opt.items if opt.weighted else float(micro_steps * world)
        big = self._squared_norm(opt) if big_batch > 0 else None
        if big is None:
            return
        if opt.reduction == "sum":  # .grad holds the sum: the mean is / big_batch
            big = big / (big_batch * big_batch)
        if small is None:  # this rank has no small batch: it counts as 0 ranks
            part, inv_small, ranks = torch.zeros_like(big), 0.0, 0.0
        else:
            part, inv_small, ranks = small[0].to(big) / (small[1] * small[1]), 1 / small[1], 1.0
        full = torch.full_like  # no host-to-device copy (it would wait for the device)
        packed = torch.stack([part, full(big, inv_small), full(big, ranks), big / world])
        opt.all_reduce_([packed])  # big is the same on every rank: its mean
        done = None
        if packed.is_cuda:  # into pinned memory, not waited for
            packed = packed.to("cpu", non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        self._pending = (packed, done, 1.0 / big_batch, big_batch / micro_steps)


class SquaredNorm:
    """``sum |g|²`` over a non-empty list of gradients (dense or sparse, any shapes, dtypes and
    devices) divided by ``loss_scale²`` (AMP's scale, a 0-dim tensor, or None): a 0-dim tensor
    on the first gradient's device, float64 if a gradient is, else float32; no host sync;
    RuntimeError for a complex gradient. Small dense CPU gradients are stacked by shape and
    dotted, the others take ``torch._foreach_norm``; one instance per model (plans per count)."""

    def __init__(self) -> None:
        self._plans: dict[int, list[Callable[[list[Tensor]], Any]] | None] = {}

    def __call__(self, grads: list[Tensor], loss_scale: Tensor | None = None) -> Tensor:
        count = len(grads)
        if count not in self._plans:
            self._plans[count] = _plan(grads)
        plan = self._plans[count]
        if plan is None:
            flat = _norms(grads)
        else:
            try:
                flat = torch.cat([torch.stack(pick(grads)).view(-1) for pick in plan])
            except RuntimeError:  # a gradient changed shape, layout or device: plan again
                del self._plans[count]
                return self(grads, loss_scale)
            if flat.numel() > _STACKED:  # grown: plan again next time
                del self._plans[count]
        if flat.is_complex():
            raise RuntimeError(f"SquaredNorm: a {flat.dtype} gradient; expected real gradients.")
        flat = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
        sq = torch.dot(flat, flat)
        if loss_scale is not None:
            sq = sq / loss_scale.to(device=sq.device, dtype=sq.dtype).square()
        return sq


_STACKED = 2**20  # at most this many elements stacked (4 MiB in float32), 2**14 per tensor


def _plan(grads: list[Tensor]) -> list[Callable[[list[Tensor]], Any]] | None:
    """A picker of the gradients of each shape, or None for the norms (large, sparse, not CPU)."""
    if sum(map(Tensor.numel, grads)) > min(_STACKED, 2**14 * len(grads)):
        return None
    if not all(g.is_cpu and g.layout == torch.strided for g in grads):
        return None
    shapes: dict[torch.Size, list[int]] = {}
    for i, g in enumerate(grads):
        shapes.setdefault(g.shape, []).append(i)
    # itemgetter of one index returns the item itself: a one-item slice returns a list
    return [
        operator.itemgetter(*index if len(index) > 1 else [slice(index[0], index[0] + 1)])
        for index in shapes.values()
    ]


def _norms(grads: list[Tensor]) -> Tensor:
    """The 2-norms of ``grads`` (sparse: of the values) in one tensor on the first's device."""
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    dense = [g.coalesce().values() if g.is_sparse else g for g in grads]
    norms = torch._foreach_norm(dense, 2, dtype=wide)
    try:
        return torch.stack(norms)
    except RuntimeError:  # gradients on several devices
        return torch.stack([n.to(grads[0].device) for n in norms])

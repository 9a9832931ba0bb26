"""Every cross-rank decision and collective of accumopt: DDP and FSDP2.

This is the only module of accumopt that uses ``torch.distributed`` (the ``testing`` helpers
that start gloo ranks aside).

With a ``DistributedDataParallel`` model, the micro-steps inside a window run without
gradient synchronisation (DDP's ``require_backward_grad_sync`` flag, what ``no_sync()`` sets),
and the micro-step that closes the window synchronises as usual, overlapped with its backward
pass: one all-reduce per real optimizer step. Where the boundary cannot be known before the
forward pass (a window in items) or finished micro-steps live in the window buffer (not in
``.grad`` where DDP's reducer looks), every micro-step runs unsynchronised and the closing one
issues one flattened ``all_reduce`` of the window's gradient itself. Item counts are summed
across ranks with ``all_reduce`` (once per update for a window in micro-steps, once per
micro-step for a window in items, whose end depends on the total), so an item-weighted window
is the mean over the items of all ranks together (DDP alone averages per-rank means).

FSDP2 (``fully_shard``) works the same way through ``set_requires_gradient_sync``: inside a
window gradients stay unsharded (full size, the memory cost users trade for less
communication), and the closing micro-step reduce-scatters them. With
``reduce_every_micro_step=True`` every micro-step reduce-scatters instead and only the sharded
sum is held: k times the communication, a 1/world-size share of the gradient memory.

``torch.distributed.fsdp`` is imported only when a model could be an FSDP2 module (that is,
when the user's program imported it already): importing accumopt stays cheap.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from accumopt import _grads
from accumopt._window import Window
from accumopt._window_buffer import WindowBuffer


def _is_fsdp(module: nn.Module | None) -> bool:
    if module is None or "torch.distributed.fsdp" not in sys.modules:
        return False  # nobody imported FSDP2, so no module is one
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def is_distributed(module: nn.Module | None) -> bool:
    """Whether ``module`` synchronises gradients across ranks (DDP, or an FSDP2 root)."""
    return isinstance(module, nn.parallel.DistributedDataParallel) or _is_fsdp(module)


class LocalSync:
    """The single-process stand-in for :class:`GradSync`: one rank, no collective."""

    fsdp = False
    world_size = 1

    def plan_next(self, window: Window, buffer: WindowBuffer, param_groups: Any) -> None:
        """Nothing to synchronise."""

    def counted(self, items: float | None, window: Window) -> float | None:
        """The item count of a micro-step is this process's own."""
        return items

    def settle_items(self, window: Window) -> None:
        """Nothing to sum."""

    def agreed_found_inf(self, scaler: object, opt: object, found_inf: Tensor) -> Tensor:
        """One process: its own inf/NaN flag."""
        return found_inf

    def restored(self, window: Window, items_global: bool) -> None:
        """Nothing to adjust after loading a window."""

    def close(self, buffer: WindowBuffer, params: list[Tensor], divisor: float | None) -> None:
        """Form the window's gradient in ``.grad``."""
        buffer.close(params, divisor)


def sync_for(
    model: nn.Module | None, device: torch.device, reduce_every_micro_step: bool
) -> GradSync | LocalSync:
    """A :class:`GradSync` for a DDP/FSDP2 model, else a :class:`LocalSync`."""
    if is_distributed(model):
        assert model is not None
        return GradSync(model, device, reduce_every_micro_step)
    return LocalSync()


class GradSync:
    """A DDP or FSDP2 model's gradient synchronisation, and every collective accumopt issues.

    Args:
        module: a ``torch.nn.parallel.DistributedDataParallel`` model, or a model sharded
            with ``torch.distributed.fsdp.fully_shard`` (FSDP2; its root module).
        device: where the small collectives' tensors live (the wrapped parameters' device).
        reduce_every_micro_step: synchronise every micro-step, not only the closing one.

    Attributes:
        fsdp (bool): whether ``module`` is an FSDP2 module (its gradients are sharded: the
            window's gradient can only be reduced by FSDP2's own reduce-scatter).
        world_size (int): ranks in the process group.
        all_reduces (int): collectives issued by accumopt itself (not by DDP or FSDP2).
        synced (bool): whether DDP/FSDP2 synchronised the last counted backward pass.

    Raises:
        TypeError: ``module`` is neither.
    """

    def __init__(
        self, module: nn.Module, device: torch.device, reduce_every_micro_step: bool = False
    ) -> None:
        self.fsdp = _is_fsdp(module)
        if not is_distributed(module):
            raise TypeError(
                f"Accumulate: model is a {type(module).__qualname__}; expected the "
                "torch.nn.parallel.DistributedDataParallel model (or the fully_shard-ed FSDP2 "
                "root module) whose parameters the inner optimizer holds; no model= in a "
                "single process."
            )
        self.module = module
        self.device = device
        self.reduce_every_micro_step = reduce_every_micro_step
        self.group: dist.ProcessGroup | None = (
            None if self.fsdp else module.process_group  # type: ignore[assignment]
        )
        self.world_size = dist.get_world_size(self.group)
        self.all_reduces = 0
        self.synced = False
        self._enabled = True

    def check_fsdp(self, every: object, scaler: object, buffer_all: bool) -> None:
        """FSDP2 gradients are sharded: only FSDP2's own reduce-scatter can combine them."""
        if not self.fsdp:
            return
        problem = None
        if every is None and not self.reduce_every_micro_step:
            problem = "every_items without reduce_every_micro_step=True (the boundary is not "
            problem += "known before the closing micro-step's backward)"
        elif scaler is not None:
            problem = "a GradScaler"
        elif buffer_all:
            problem = "the window buffer (buffer=True or a per-micro-batch nonfinite policy)"
        if problem is not None:
            raise ValueError(
                f"Accumulate: an FSDP2 model with {problem} is not supported; expected "
                "every=N (or reduce_every_micro_step=True), no scaler and buffer=None."
            )

    # ------------------------------------------------------------------ sync on/off

    @property
    def enabled(self) -> bool:
        """Whether the next (or the running) backward pass synchronises gradients."""
        if self.fsdp:
            return self._enabled
        return bool(self.module.require_backward_grad_sync)

    def set_sync(self, enabled: bool) -> None:
        """Let (True) or stop (False) DDP's all-reduce / FSDP2's reduce-scatter in the next
        backward pass (DDP's ``no_sync``; FSDP2's ``set_requires_gradient_sync``)."""
        if self.fsdp:
            if enabled != self._enabled:
                self.module.set_requires_gradient_sync(enabled)  # type: ignore[operator]
                self._enabled = enabled
        else:
            setattr(self.module, "require_backward_grad_sync", enabled)  # noqa: B010

    def plan_next(
        self, window: Window, buffer: WindowBuffer, param_groups: list[dict[str, Any]]
    ) -> None:
        """Let DDP/FSDP2 synchronise the next backward pass only if it closes the window and
        every finished micro-step lives in ``.grad``, where their reducer looks; otherwise
        accumopt reduces the window itself at the boundary."""
        if self.reduce_every_micro_step:
            self.set_sync(True)
        else:
            grad_only = buffer.grad_only(_grads.params_of(param_groups))
            self.set_sync(grad_only and window.next_closes())

    def counted(self, items: float | None, window: Window) -> float | None:
        """A micro-step was counted: remember whether it was synchronised. Return its item
        count summed over the ranks (one small all-reduce) where the window is counted in
        items (its end depends on the total); else this rank's own, summed once at the
        boundary by :meth:`settle_items`."""
        self.synced = self.enabled
        if items is None or window.every is not None:
            return items
        return self.sum(items)

    def restored(self, window: Window, items_global: bool) -> None:
        """A window was loaded from a checkpoint: no pass of it was synchronised by DDP (unless
        every micro-step is), and an item count saved already summed over the ranks (formats
        1-2) is kept by rank 0 alone, so the boundary's sum gives it back exactly."""
        self.synced = self.reduce_every_micro_step
        in_steps = window.weighted and window.every is not None
        if items_global and in_steps and dist.get_rank(self.group) != 0:
            window.items = 0.0

    def agreed_found_inf(self, scaler: object, opt: object, found_inf: Tensor) -> Tensor:
        """Under ``scaler.step(opt)``: make every rank see an inf/NaN that any rank saw (one
        small all-reduce), in the scaler's own record too, so that all ranks skip the same
        windows and ``scaler.update()`` keeps one loss scale on every rank."""
        states = scaler._per_optimizer_states  # type: ignore[attr-defined]
        flags: list[Tensor] = list(states[id(opt)]["found_inf_per_device"].values())
        for flag in flags:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            self.all_reduces += 1
        agreed = found_inf.new_zeros(())
        for flag in flags:
            agreed += flag.to(found_inf.device)
        return agreed if flags else found_inf

    def settle_items(self, window: Window) -> None:
        """At the boundary of a weighted window counted in micro-steps: sum its items over the
        ranks (one small all-reduce per update instead of one per micro-step)."""
        if window.weighted and window.every is not None:
            window.items = self.sum(window.items)

    # ------------------------------------------------------------------ collectives

    def sum(self, value: float) -> float:
        """The sum of ``value`` over all ranks (one small all-reduce, one host sync)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        self.all_reduces += 1
        return float(t.item())

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether it is True on any rank (one all-reduce)."""
        t = torch.tensor(flags, dtype=torch.float32, device=self.device)
        dist.all_reduce(t, group=self.group)
        self.all_reduces += 1
        return [bool(v > 0) for v in t.tolist()]

    def close(self, buffer: WindowBuffer, params: list[Tensor], divisor: float | None) -> None:
        """Form the window's gradient over all ranks in ``.grad`` (``divisor``: what the sum
        over all ranks is divided by; None: not at all)."""
        if self.synced:  # DDP's reducer averaged the window over the ranks already
            buffer.close(params, None if divisor is None else divisor / self.world_size)
            return
        buffer.close(params, None)  # one all-reduce of the whole window's gradient
        trainable = [p for p in params if p.requires_grad]
        used = self.any_rank([p.grad is not None for p in trainable])
        for p in trainable:
            if p.grad is None:  # every rank must reduce the same tensors
                p.grad = torch.zeros_like(p)
        self.sum_grads([p.grad for p in trainable])  # type: ignore[misc]
        for p, anywhere in zip(trainable, used):
            if not anywhere:  # unused on every rank: no gradient, as in one process
                p.grad = None
        if divisor is not None and divisor != 1:
            _grads.div_(_grads.grads_of(trainable), divisor)

    @torch.no_grad()
    def sum_grads(self, grads: list[Tensor]) -> None:
        """Sum every dense gradient over the ranks, in place, in one flattened all-reduce per
        (device, dtype). All ranks must pass gradients of the same shapes in the same order."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            if g.is_sparse:
                raise RuntimeError(
                    "Accumulate: sparse gradients cannot be summed across ranks by accumopt; "
                    "expected dense gradients under DistributedDataParallel."
                )
            groups.setdefault((g.device, g.dtype), []).append(g)
        for tensors in groups.values():
            flat = _flatten_dense_tensors(tensors)  # type: ignore[no-untyped-call]
            dist.all_reduce(flat, group=self.group)
            self.all_reduces += 1
            pieces = _unflatten_dense_tensors(flat, tensors)  # type: ignore[no-untyped-call]
            for g, reduced in zip(tensors, pieces):
                g.copy_(reduced)

    # ------------------------------------------------------------------ the runner's agreements

    def failed_ranks(self, failed: bool) -> float:
        """How many ranks report a failed micro-batch (one all-reduce): all ranks then drop
        or all count it, so nobody waits in a collective another rank never reaches."""
        return self.sum(float(failed))

    def check_same_rows(self, rows: int, api: str) -> None:
        """Refuse batches whose row counts differ across ranks (two small all-reduces): the
        ranks must cut them the same way, or their collectives would not pair up."""
        total, squares = self.sum(float(rows)), self.sum(float(rows * rows))
        if squares * self.world_size != total * total:  # equal on every rank
            raise ValueError(
                f"{api}: this rank's batch has {rows} rows, the ranks' batches {total:g} "
                "together; expected the same number of rows on every rank with "
                "micro_batch_size='auto' under torch.distributed (all ranks back off together)."
            )

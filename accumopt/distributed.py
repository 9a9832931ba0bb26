"""Gradient synchronisation across ranks for ``Accumulate`` (the only module using
``torch.distributed``): DDP and FSDP2.

With a ``DistributedDataParallel`` model, the micro-steps inside a window run without
gradient synchronisation (DDP's ``require_backward_grad_sync`` flag, what ``no_sync()`` sets),
and the micro-step that closes the window synchronises as usual, overlapped with its backward
pass: one all-reduce per real optimizer step. Where the boundary cannot be known before the
forward pass (a window in items) or finished micro-steps live in the window buffer (not in
``.grad`` where DDP's reducer looks), every micro-step runs unsynchronised and the closing one
issues one flattened ``all_reduce`` of the window's gradient itself. Item counts are summed
across ranks with ``all_reduce``, so an item-weighted window is the mean over the items of all
ranks together (DDP alone averages per-rank means).

FSDP2 (``fully_shard``) works the same way through ``set_requires_gradient_sync``: inside a
window gradients stay unsharded (full size, the memory cost users trade for less
communication), and the closing micro-step reduce-scatters them. With
``reduce_every_micro_step=True`` every micro-step reduce-scatters instead and only the sharded
sum is held: k times the communication, a 1/world-size share of the gradient memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import FSDPModule


def is_distributed(module: nn.Module | None) -> bool:
    """Whether ``module`` synchronises gradients across ranks (DDP, or an FSDP2 root)."""
    return isinstance(module, (nn.parallel.DistributedDataParallel, FSDPModule))


class GradSync:
    """Switch a DDP or FSDP2 model's gradient synchronisation, and reduce across ranks.

    Args:
        module: a ``torch.nn.parallel.DistributedDataParallel`` model, or a model sharded
            with ``torch.distributed.fsdp.fully_shard`` (FSDP2; its root module).

    Attributes:
        fsdp (bool): whether ``module`` is an FSDP2 module (its gradients are sharded: the
            window's gradient can only be reduced by FSDP2's own reduce-scatter).
        world_size (int): ranks in the process group.
        all_reduces (int): collectives issued by accumopt itself (not by DDP or FSDP2).

    Raises:
        TypeError: ``module`` is neither.
    """

    def __init__(self, module: nn.Module) -> None:
        self.fsdp = isinstance(module, FSDPModule)
        if not is_distributed(module):
            raise TypeError(
                f"Accumulate: model is a {type(module).__qualname__}; expected the "
                "torch.nn.parallel.DistributedDataParallel model (or the fully_shard-ed FSDP2 "
                "root module) whose parameters the inner optimizer holds; no model= in a "
                "single process."
            )
        self.module = module
        self.group: dist.ProcessGroup | None = (
            None if self.fsdp else module.process_group  # type: ignore[assignment]
        )
        self.world_size = dist.get_world_size(self.group)
        self.all_reduces = 0
        self._enabled = True

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

    def sum(self, value: float, device: torch.device) -> float:
        """The sum of ``value`` over all ranks (one small all-reduce, one host sync)."""
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.group)
        self.all_reduces += 1
        return float(t.item())

    def any_rank(self, flags: list[bool], device: torch.device) -> list[bool]:
        """For each flag, whether it is True on any rank (one all-reduce)."""
        t = torch.tensor(flags, dtype=torch.float32, device=device)
        dist.all_reduce(t, group=self.group)
        self.all_reduces += 1
        return [bool(v > 0) for v in t.tolist()]

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

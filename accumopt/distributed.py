"""Gradient synchronisation across ranks for ``Accumulate`` (the only module using
``torch.distributed``).

With a ``DistributedDataParallel`` model, the micro-steps inside a window run without
gradient synchronisation (DDP's ``require_backward_grad_sync`` flag, what ``no_sync()`` sets),
and the micro-step that closes the window synchronises as usual, overlapped with its backward
pass: one all-reduce per real optimizer step. Where the boundary cannot be known before the
forward pass (a window in items) or finished micro-steps live in the window buffer (not in
``.grad`` where DDP's reducer looks), every micro-step runs unsynchronised and the closing one
issues one flattened ``all_reduce`` of the window's gradient itself. Item counts are summed
across ranks with ``all_reduce``, so an item-weighted window is the mean over the items of all
ranks together (DDP alone averages per-rank means).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class GradSync:
    """Switch a DDP model's gradient synchronisation, and reduce across its process group.

    Args:
        module: a ``torch.nn.parallel.DistributedDataParallel`` model.

    Raises:
        TypeError: ``module`` is not a ``DistributedDataParallel``.
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"Accumulate: model is a {type(module).__qualname__}; expected the "
                "torch.nn.parallel.DistributedDataParallel model whose parameters the inner "
                "optimizer holds (or no model= in a single process)."
            )
        self.module = module
        self.group = module.process_group
        self.world_size = dist.get_world_size(self.group)
        self.all_reduces = 0  # collectives issued by accumopt (not by DDP's reducer)

    def set_sync(self, enabled: bool) -> None:
        """Let (True) or stop (False) DDP's reducer all-reduce in the next backward pass."""
        self.module.require_backward_grad_sync = enabled

    def sum(self, value: float, device: torch.device) -> float:
        """The sum of ``value`` over all ranks (one small all-reduce, one host sync)."""
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.group)
        self.all_reduces += 1
        return float(t.item())

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

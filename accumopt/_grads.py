"""In-place arithmetic on gradients: dense ones in batched ``torch._foreach_*`` calls."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter, is_not

import torch
from torch import Tensor

_GRAD = attrgetter("grad")
_TENSOR_DIVISOR = frozenset((torch.float32, torch.float64))


def params_of(param_groups: Iterable[dict[str, object]]) -> list[Tensor]:
    """All parameters of ``param_groups``, in state-dict order (group by group)."""
    return [p for group in param_groups for p in group["params"]]  # type: ignore[attr-defined]


def same_listing(listed: list[Tensor] | None, params: list[Tensor]) -> list[Tensor]:
    """``listed`` (the same object) if it holds the tensors of ``params`` in order, else those."""
    if listed is not None and len(listed) == len(params) and not any(map(is_not, params, listed)):
        return listed
    return params


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """The ``.grad`` tensors that exist, in parameter order."""
    grads = list(map(_GRAD, params))
    return grads if all(map(is_not, grads, repeat(None))) else [g for g in grads if g is not None]


def by_kind(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped by (device, dtype), in order."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def holds_indices(total: Tensor, part: Tensor) -> bool:
    """Whether ``total`` holds every index of the sparse ``part`` (as a sum accumulated from it)."""
    if not total.is_sparse:
        return True
    if total.sparse_dim() != part.sparse_dim() or total.shape != part.shape:
        return False
    return bool(torch.isin(_linear_indices(part), _linear_indices(total)).all())


def _linear_indices(sparse: Tensor) -> Tensor:
    """The sparse dimensions' indices of each entry of a COO tensor as one integer."""
    indices = sparse._indices()
    flat = indices[0]
    for dim in range(1, sparse.sparse_dim()):
        flat = flat * sparse.shape[dim] + indices[dim]
    return flat


@functools.lru_cache(maxsize=16)  # a window's divisor rarely changes
def _cpu_scalar(value: float, dtype: torch.dtype) -> Tensor:
    return torch.tensor(value, dtype=dtype)


def div_(grads: list[Tensor], divisor: float | Tensor) -> None:
    """Divide every gradient in place by ``divisor`` (a number or a 0-dim tensor), recording no
    history; CPU float32/64 ones by a 0-dim tensor (2-4x faster than a number, bit-identical)."""
    if torch.is_grad_enabled():  # outside the autograd engine's final callback
        with torch.no_grad():
            div_(grads, divisor)
        return
    if not isinstance(divisor, Tensor):  # the usual case, found in two C-level passes
        dtypes = set(map(attrgetter("dtype"), grads))
        if len(dtypes) == 1 and dtypes <= _TENSOR_DIVISOR and all(map(attrgetter("is_cpu"), grads)):
            torch._foreach_div_(grads, _cpu_scalar(float(divisor), dtypes.pop()))
            return
    dense = [g for g in grads if not g.is_sparse]
    if dense and isinstance(divisor, Tensor):
        torch._foreach_div_(dense, divisor)
    elif dense:
        for (device, dtype), tensors in by_kind(dense).items():
            cpu = device.type == "cpu" and dtype in _TENSOR_DIVISOR
            torch._foreach_div_(tensors, _cpu_scalar(float(divisor), dtype) if cpu else divisor)
    if len(dense) != len(grads):
        for g in grads:
            if g.is_sparse:
                g.div_(divisor)


@torch.no_grad()
def unscale_(grads: list[Tensor], scale: Tensor) -> Tensor:
    """Divide every gradient in place by the loss ``scale`` (0-dim float32) without a host sync;
    returns a 0-dim float32 tensor on ``scale.device``, > 0 if any held an inf or NaN."""
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    inv_scale = scale.double().reciprocal().float()
    for (device, _), tensors in by_kind(g._values() if g.is_sparse else g for g in grads).items():
        local_inf = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, local_inf, inv_scale.to(device))
        found_inf += local_inf.to(scale.device)
    return found_inf


@torch.no_grad()
def clip_(params: list[Tensor], max_norm: float) -> Tensor:
    """``clip_grad_norm_(params, max_norm)``, also for sparse gradients (their coalesced values'
    norm); returns the total 2-norm before clipping (0-dim). ``max_norm=inf`` only measures."""
    grads = grads_of(params)
    if not any(g.is_sparse for g in grads):
        if max_norm != math.inf:
            total: Tensor = torch.nn.utils.clip_grad_norm_(params, max_norm)
            return total
        return torch.nn.utils.get_total_norm(grads)
    norms = [torch.linalg.vector_norm(g) for g in grads if not g.is_sparse]
    norms += [torch.linalg.vector_norm(g.coalesce().values()) for g in grads if g.is_sparse]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if max_norm != math.inf:  # torch's 1e-6 guard and coefficient clamped to 1
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return total


def all_finite(grads: list[Tensor]) -> bool:
    """Whether no gradient holds an inf or NaN (a fused check per device and dtype, one sync)."""
    if not grads:
        return True
    one = torch.ones((), dtype=torch.float32, device=grads[0].device)
    return bool(unscale_(grads, one).item() == 0)

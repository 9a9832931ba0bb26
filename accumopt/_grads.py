"""In-place arithmetic on gradients, batched with ``torch._foreach_*`` where torch allows it.

Private helpers shared by the accumulation logic. Dense gradients go through one
``torch._foreach_*`` call per operation (torch groups them by device and dtype internally);
sparse gradients, which the foreach kernels do not take, are handled one by one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter, is_not

import torch
from torch import Tensor


def params_of(param_groups: Iterable[dict[str, object]]) -> list[Tensor]:
    """All parameters of ``param_groups``, in state-dict order (group by group)."""
    return [p for group in param_groups for p in group["params"]]  # type: ignore[attr-defined]


def same_listing(listed: list[Tensor] | None, params: list[Tensor]) -> list[Tensor]:
    """``listed`` where it holds the tensors of ``params`` in the same order (the same list
    object while nothing changed), else ``params``."""
    if listed is not None and len(listed) == len(params) and not any(map(is_not, params, listed)):
        return listed
    return params


_GRAD = attrgetter("grad")


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """The ``.grad`` tensors that exist, in parameter order."""
    return present(list(map(_GRAD, params)))


def _split_sparse(grads: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    dense = [g for g in grads if not g.is_sparse]
    sparse = [g for g in grads if g.is_sparse] if len(dense) != len(grads) else []
    return dense, sparse


def holds_indices(total: Tensor, part: Tensor) -> bool:
    """Whether ``total`` has an entry at every index where the sparse ``part`` has one: true
    of a sum accumulated from ``part`` (concatenated, or coalesced into the union of the
    indices); a dense ``total`` (sparse plus dense accumulation) counts as holding it. Used to
    tell a sparse gradient that accumulation replaced from one cleared and rebuilt."""
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


_TENSOR_DIVISOR = (torch.float32, torch.float64)
_DTYPE = attrgetter("dtype")
_IS_CPU = attrgetter("is_cpu")


@functools.lru_cache(maxsize=16)
def _cpu_scalar(value: float, dtype: torch.dtype) -> Tensor:
    """A 0-dim CPU tensor holding ``value`` (cached: a window's divisor rarely changes)."""
    return torch.tensor(value, dtype=dtype)


def present(grads: list[Tensor | None]) -> list[Tensor]:
    """``grads`` without its None entries (the list itself when it has none)."""
    if all(map(is_not, grads, repeat(None))):
        return grads  # type: ignore[return-value]
    return [g for g in grads if g is not None]


def div_(grads: list[Tensor], divisor: float | Tensor) -> None:
    """Divide every gradient in place by ``divisor`` (a Python number or a 0-dim tensor).

    On the CPU a Python number is turned into one 0-dim tensor per dtype group of float32 or
    float64 gradients: torch's CPU foreach kernels take that overload 2-4x faster than a
    number, with bit-identical results (the number is rounded to the gradients' dtype either
    way; the CPU kernels run tensor by tensor, sparse ones too). Other dtypes divide by the
    number itself (a bf16/fp16 gradient is not divided by a divisor rounded to bf16/fp16), and
    so do accelerators (a new device tensor would cost a host-to-device copy; their foreach
    kernels are fused anyway). The usual case (CPU gradients of one such dtype) is recognised
    in two C-level passes over the gradients and divided in one call. Gradients with a history
    (``create_graph=True``) are divided without recording one.
    """
    if torch.is_grad_enabled():  # outside the autograd engine's final callback
        with torch.no_grad():
            _div(grads, divisor)
    else:
        _div(grads, divisor)


def _div(grads: list[Tensor], divisor: float | Tensor) -> None:
    if not isinstance(divisor, Tensor):
        dtypes = set(map(_DTYPE, grads))
        if len(dtypes) == 1 and all(map(_IS_CPU, grads)):
            dtype = dtypes.pop()
            if dtype in _TENSOR_DIVISOR:
                torch._foreach_div_(grads, _cpu_scalar(float(divisor), dtype))
                return
    dense, sparse = _split_sparse(grads)
    if dense and isinstance(divisor, Tensor):
        torch._foreach_div_(dense, divisor)
    elif dense:
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in dense:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), tensors in groups.items():
            if device.type == "cpu" and dtype in _TENSOR_DIVISOR:
                torch._foreach_div_(tensors, _cpu_scalar(float(divisor), dtype))
            else:
                torch._foreach_div_(tensors, divisor)
    for g in sparse:
        g.div_(divisor)


@torch.no_grad()
def unscale_(grads: list[Tensor], scale: Tensor) -> Tensor:
    """Divide every gradient in place by the loss scale and report inf/NaN, without a host sync.

    Args:
        grads: gradient tensors (dense or sparse), any devices and floating dtypes.
        scale: 0-dim float32 tensor, the loss scale the gradients were computed under.

    Returns:
        A 0-dim float32 tensor on ``scale.device``, > 0 when any gradient held an inf or NaN.
    """
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    inv_scale = scale.double().reciprocal().float()
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g._values() if g.is_sparse else g)
    for (device, _), tensors in groups.items():
        local_inf = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, local_inf, inv_scale.to(device))
        found_inf += local_inf.to(scale.device)
    return found_inf


@torch.no_grad()
def clip_(params: list[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``, also for sparse gradients;
    returns the total 2-norm before clipping (0-dim tensor). ``max_norm=inf`` only measures.

    torch's clipping has no sparse norm; a sparse gradient's norm is that of its coalesced
    values (duplicate indices summed first), and it is scaled in place like a dense one. The
    total norm, the ``1e-6`` guard and the coefficient clamped to 1 are torch's.
    """
    grads = grads_of(params)
    dense, sparse = _split_sparse(grads)
    if not sparse and max_norm != math.inf:
        total: Tensor = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return total
    if not sparse:
        return torch.nn.utils.get_total_norm(dense)
    norms = [torch.linalg.vector_norm(g) for g in dense]
    norms += [torch.linalg.vector_norm(g.coalesce().values()) for g in sparse]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    if max_norm != math.inf:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return total


def all_finite(grads: list[Tensor]) -> bool:
    """Whether every gradient is free of inf and NaN (one fused check per device and dtype,
    as ``GradScaler`` does it, and one host sync)."""
    if not grads:
        return True
    one = torch.ones((), dtype=torch.float32, device=grads[0].device)
    return bool(unscale_(grads, one).item() == 0)

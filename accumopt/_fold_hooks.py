"""Fold a low-precision gradient into its float32 window sum as soon as autograd has
accumulated it, so that at most one bf16/fp16 gradient is alive beside the window's sums.

Without this, a bf16 micro-step's whole gradient sits in ``.grad`` until the backward pass
ends and is folded then: the float32 sums (2 bytes per parameter byte) and that gradient (1)
coexist, 3x the parameter bytes. A ``Tensor.register_post_accumulate_grad_hook`` hook runs
right after autograd wrote one parameter's ``.grad``; the window buffer adds it into the sum
there and releases ``.grad`` (``None``), which keeps gradients and sums at about 2x (plus one
parameter's gradient). The hooks are registered once per parameter and removed when their
owner (the window buffer, hence the wrapper) is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from accumopt._backward_counter import _remove_all

_CHUNK = 1 << 20
"""Elements per piece of a CPU ``float32 += bf16`` add (see :func:`add_promoted_`)."""


def single_process() -> bool:
    """Whether no ``torch.distributed`` process group exists. Under DDP (given to the wrapper
    or not) the reducer reads ``.grad`` after the post-accumulate hooks ran, and FSDP2 writes
    sharded gradients itself: a gradient folded away there would be all-reduced as zeros."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized())


def add_promoted_(total: Tensor, grad: Tensor) -> None:
    """``total += grad`` for a float32/float64 ``total`` and a bf16/fp16 ``grad``, in place
    (neither with a history: :func:`fold_one` runs it without grad).

    On the CPU torch materialises the promoted (float32) copy of ``grad`` before adding: a
    temporary twice ``grad``'s bytes. Contiguous tensors are added in pieces of ``_CHUNK``
    elements so that temporary stays at 4 MiB. Same values as one ``add_`` (an element-wise
    add in the promoted dtype either way). Accelerators cast inside the kernel: one call.
    """
    if grad.device.type != "cpu" or grad.numel() <= _CHUNK:
        total.add_(grad)
    elif total.is_contiguous() and grad.is_contiguous():
        pieces = zip(torch.split(total.view(-1), _CHUNK), torch.split(grad.view(-1), _CHUNK))
        for into, piece in pieces:
            into.add_(piece)
    else:
        total.add_(grad)


@torch.no_grad()
def fold_one(sums: dict[Tensor, Tensor], param: Tensor, dtype: torch.dtype) -> None:
    """Add ``param``'s dense ``.grad`` into ``sums[param]`` (a ``dtype`` copy of it the first
    time), then release ``.grad``. A sparse one is left (folded at the micro-step's end)."""
    grad = param.grad
    if grad is None or grad.is_sparse:
        return
    total = sums.get(param)
    if total is None:
        sums[param] = grad.to(dtype)
    else:
        add_promoted_(total, grad)
    param.grad = None


class FoldHooks:
    """One post-accumulate-grad hook per watched parameter, calling ``on_grad(param)``.

    Args:
        on_grad: a bound method; its object is held weakly (the parameters hold the hooks, and
            must not keep the wrapper alive), and the hooks are removed when this object is
            freed (it lives as long as its owner).
    """

    def __init__(self, on_grad: Callable[[Tensor], None]) -> None:
        owner_ref = weakref.ref(on_grad.__self__)  # type: ignore[attr-defined]
        function = on_grad.__func__  # type: ignore[attr-defined]

        def hook(param: Tensor) -> None:
            owner = owner_ref()
            if owner is not None:
                function(owner, param)

        self._hook = hook
        self._handles: list[RemovableHandle] = []
        weakref.finalize(self, _remove_all, self._handles)

    def __bool__(self) -> bool:
        return bool(self._handles)

    def watch(self, params: Iterable[Tensor]) -> None:
        """Hook every parameter of ``params`` that requires grad and is not hooked yet
        (idempotent: call again for parameters unfrozen since)."""
        for p in params:
            hooks = p._post_accumulate_grad_hooks
            if p.requires_grad and (hooks is None or self._hook not in hooks.values()):
                handle = p.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]
                self._handles.append(handle)

    def remove(self) -> None:
        """Remove every hook."""
        _remove_all(self._handles)

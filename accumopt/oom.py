"""Recognise out-of-memory errors, whatever form torch raises them in, and free memory after one.

torch raises an allocation failure as ``torch.OutOfMemoryError`` (CUDA's caching allocator,
recent XPU/MPS builds), but also as a plain ``RuntimeError`` whose text is the only clue: the
CPU allocator (``DefaultCPUAllocator: can't allocate memory``), cuBLAS and cuDNN workspace
allocations, and older backends. :func:`is_oom` checks the type first, then the known texts.
"""

from __future__ import annotations

import gc

import torch

OOM_MESSAGES = (
    "out of memory",  # CUDA / HIP / XPU caching allocators, "CUDA error: out of memory"
    "DefaultCPUAllocator: can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
    "non-contiguous input",  # cuDNN's report of a workspace it could not allocate
    "MPS backend out of memory",
)
"""Substrings of ``RuntimeError`` messages that torch uses for allocation failures."""


def is_oom(error: BaseException) -> bool:
    """Whether ``error``, or an exception it wraps, is an out-of-memory error that a smaller
    micro-batch may avoid.

    Each exception of the chain Python prints in a traceback is checked: ``error``, its
    ``__cause__`` (``raise ... from oom``) and its ``__context__`` (raised while handling
    ``oom``; not followed after ``raise ... from None``), and theirs in turn; a cycle in the
    chain is walked once.

    Args:
        error: any exception.

    Returns:
        True when an exception of the chain is a ``torch.OutOfMemoryError`` (any text) or a
        ``RuntimeError`` whose message contains one of :data:`OOM_MESSAGES`.

    Example:
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
        True
        >>> is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
        >>> try:
        ...     try:
        ...         raise torch.OutOfMemoryError("CUDA out of memory")
        ...     except torch.OutOfMemoryError as oom:
        ...         raise RuntimeError("forward of block 3 failed") from oom
        ... except RuntimeError as wrapped:
        ...     is_oom(wrapped)
        True
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        if _is_oom_itself(link):
            return True
        pending.append(link.__cause__)
        if not link.__suppress_context__:
            pending.append(link.__context__)
    return False


def _is_oom_itself(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(f in str(error) for f in OOM_MESSAGES)


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver (call outside ``except``:
    a live exception's traceback keeps the failed micro-batch's tensors alive)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def memory_report(device: torch.device | None) -> str:
    """A one-line summary of the device's memory, for error messages."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        gib = 2.0**30
        return (
            f"{device}: {free / gib:.2f} GiB free of {total / gib:.2f} GiB, "
            f"{reserved / gib:.2f} GiB reserved by torch, peak allocated {peak / gib:.2f} GiB"
        )
    return f"{device or 'cpu'}: no allocator statistics for this device"

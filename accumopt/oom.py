"""Recognise out-of-memory errors in any form torch raises them (``torch.OutOfMemoryError``, the
``RuntimeError`` texts of the CPU allocator, cuBLAS, cuDNN, MPS), and free memory after one."""

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
    """Whether ``error``, or an exception of its chain as Python prints it (``__cause__``, and
    ``__context__`` unless ``raise ... from None``), is a ``torch.OutOfMemoryError`` or a
    ``RuntimeError`` with one of :data:`OOM_MESSAGES`: an error a smaller micro-batch may avoid.

    Examples:
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
        True
        >>> wrapped = RuntimeError("forward of block 3 failed")
        >>> wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory")  # raise ... from
        >>> is_oom(wrapped)
        True
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        if isinstance(link, torch.OutOfMemoryError) or (
            isinstance(link, RuntimeError) and any(m in str(link) for m in OOM_MESSAGES)
        ):
            return True
        pending += [link.__cause__, None if link.__suppress_context__ else link.__context__]
    return False


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver (call outside ``except``:
    a live exception's traceback keeps the failed micro-batch's tensors alive)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def memory_report(device: torch.device | None) -> str:
    """A one-line summary of the device's memory, for error messages."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return f"{device or 'cpu'}: no allocator statistics for this device"
    gib = 2.0**30
    free, total = torch.cuda.mem_get_info(device)
    reserved, peak = torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device)
    return (
        f"{device}: {free / gib:.2f} GiB free of {total / gib:.2f} GiB, "
        f"{reserved / gib:.2f} GiB reserved by torch, peak allocated {peak / gib:.2f} GiB"
    )

"""Testing helpers: simulated out-of-memory errors, and gloo process groups, on any machine.

``simulate_oom(module, limit)`` raises a real ``torch.OutOfMemoryError`` (or the plain
``RuntimeError`` the CPU allocator raises) whenever a micro-batch of more than ``limit`` rows
passes through ``module``: in the forward pass, or in the middle of the backward pass after
the gradients of the layers behind ``at`` were already written. It is how accumopt's OOM
recovery is tested without a GPU, and how ``examples/autosize_digits.py`` shows it.

``run_ranks(target, *args)`` runs a function on several CPU processes joined in a gloo
process group (how the DDP and FSDP2 paths are tested and benchmarked on one machine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn


@dataclass
class SimulatedOOM:
    """What :func:`simulate_oom` saw: every micro-batch size and every injected failure."""

    limit: int
    sizes: list[int] = field(default_factory=list)
    raised: list[int] = field(default_factory=list)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise TypeError("simulate_oom: the module was called without a tensor argument")


def _error(kind: str, rows: int, limit: int) -> RuntimeError:
    if kind == "cpu":
        return RuntimeError(
            f"[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory: "
            f"simulated, {rows} rows > limit {limit}"
        )
    return torch.OutOfMemoryError(
        f"CUDA out of memory (simulated by accumopt.testing): {rows} rows > limit {limit}"
    )


@contextmanager
def simulate_oom(
    module: nn.Module,
    limit: int,
    *,
    where: Literal["forward", "backward"] = "forward",
    at: nn.Module | None = None,
    kind: Literal["cuda", "cpu"] = "cuda",
) -> Iterator[SimulatedOOM]:
    """Make ``module`` run out of memory on micro-batches of more than ``limit`` rows.

    Args:
        module: the module whose calls are watched (the batch size is dim 0 of its first
            tensor argument).
        limit: the largest micro-batch that "fits", in rows.
        where: ``"forward"``: raise when ``module`` is called; ``"backward"``: raise during
            the backward pass, when the gradient reaches the output of ``at`` (after the
            gradients of every layer behind it were accumulated into ``.grad``).
        at: the submodule where the backward failure strikes (default: ``module``, i.e.
            before any parameter gradient of ``module`` is written).
        kind: ``"cuda"`` raises ``torch.OutOfMemoryError``; ``"cpu"`` the plain
            ``RuntimeError`` of torch's CPU allocator.

    Yields:
        A :class:`SimulatedOOM` record of the sizes seen and the failures raised.
    """
    record = SimulatedOOM(limit)

    def check(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rows = _rows(args, kwargs)
        record.sizes.append(rows)
        if rows > limit and where == "forward":
            record.raised.append(rows)
            raise _error(kind, rows, limit)

    def arm(_: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        rows = _rows(args, {})
        if rows > limit and isinstance(output, Tensor) and output.requires_grad:

            def fail(grad: Tensor) -> None:
                record.raised.append(rows)
                raise _error(kind, rows, limit)

            output.register_hook(fail)  # type: ignore[no-untyped-call]

    handles = [module.register_forward_pre_hook(check, with_kwargs=True)]
    if where == "backward":
        handles.append((at or module).register_forward_hook(arm))
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    timeout_s: float,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        queue.put((rank, target(rank, *args)))
    except BaseException as err:  # report it, so the parent does not wait for a result
        queue.put((rank, RankFailed(f"rank {rank}: {type(err).__name__}: {err}")))
        raise
    finally:
        dist.destroy_process_group()


class RankFailed(RuntimeError):
    """A rank of :func:`run_ranks` raised; the message names the rank and the error."""


def run_ranks(
    target: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 120
) -> list[Any]:
    """Run ``target(rank, *args)`` in ``world_size`` fresh processes joined in a gloo group.

    Each process initialises ``torch.distributed`` (gloo, a file store in a temporary folder,
    collectives timing out after ``timeout_s`` seconds), calls ``target`` and sends its result
    back; the results come back in rank order. Children are daemons, killed if they outlive
    the call, so a rank stuck in a collective cannot hang the caller. ``target`` must be a
    module-level function and its result picklable without shared memory (plain Python
    values: ``tensor.tolist()``, not tensors).

    Raises:
        RankFailed: a rank raised (the first failure, by rank).
        queue.Empty: no result within ``2 * timeout_s`` seconds.
    """
    import multiprocessing
    import os
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, store, timeout_s, target, args, queue),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            results = sorted((queue.get(timeout=2 * timeout_s) for _ in procs), key=lambda r: r[0])
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    for _, result in results:
        if isinstance(result, RankFailed):
            raise result
    return [result for _, result in results]

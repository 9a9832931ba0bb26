"""Testing helpers for any machine: simulated out-of-memory errors (:func:`simulate_oom`), and
functions run on several CPU processes joined in a gloo group (:func:`run_ranks`)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


@dataclass
class SimulatedOOM:
    """What :func:`simulate_oom` saw (``limit``; ``sizes``: the rows of every call of the
    watched module, in order; ``raised``: those of the calls made to fail), and the handle that
    removes its hooks: a context manager, or call :meth:`remove` (twice is harmless)."""

    limit: int
    sizes: list[int] = field(default_factory=list)
    raised: list[int] = field(default_factory=list)
    _handles: list[RemovableHandle] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @property
    def active(self) -> bool:
        """Whether the hooks are still installed."""
        return bool(self._handles)

    def remove(self) -> None:
        """Remove the hooks: the module runs normally again (the record is kept)."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> SimulatedOOM:
        if not self.active:
            raise RuntimeError(
                "simulate_oom: this simulation was already removed; expected a fresh "
                "simulate_oom(module, limit) for each with-block."
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def simulate_oom(
    module: nn.Module,
    limit: int,
    *,
    where: Literal["forward", "backward"] = "forward",
    at: nn.Module | None = None,
    kind: Literal["cuda", "cpu"] = "cuda",
) -> SimulatedOOM:
    """Make ``module`` run out of memory on micro-batches of more than ``limit`` (>= 0) rows
    (dim 0 of its first tensor argument, TypeError if none) until the hooks are removed (the end
    of ``with simulate_oom(model, 40) as sim:``, or ``sim.remove()``).

    Args:
        where: ``"forward"``: raise when ``module`` is called; ``"backward"``: raise in the
            backward pass when the gradient reaches the output of ``at`` (default ``module``),
            after the layers behind it wrote their ``.grad``.
        kind: ``"cuda"`` raises ``torch.OutOfMemoryError``; ``"cpu"`` the CPU allocator's error.

    Returns the record (:class:`SimulatedOOM`); ValueError for bad arguments.
    """
    if where not in ("forward", "backward"):
        raise ValueError(f"simulate_oom: where={where!r}; expected 'forward' or 'backward'.")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"simulate_oom: kind={kind!r}; expected 'cuda' or 'cpu'.")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"simulate_oom: limit={limit!r}; expected an int >= 0 (rows).")
    record = SimulatedOOM(limit)

    def rows_of(values: Any) -> int:
        for value in values:
            if isinstance(value, Tensor) and value.dim() > 0:
                return int(value.shape[0])
        raise TypeError("simulate_oom: no tensor argument; expected a batch tensor (dim 0: rows).")

    def fail(rows: int) -> None:
        record.raised.append(rows)
        end = f"{rows} rows > limit {limit}"
        if kind == "cpu":
            cpu = "[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"
            raise RuntimeError(f"{cpu}: simulated, {end}")
        raise torch.OutOfMemoryError(f"CUDA out of memory (simulated by accumopt.testing): {end}")

    def check(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rows = rows_of([*args, *kwargs.values()])
        record.sizes.append(rows)
        if rows > limit and where == "forward":
            fail(rows)

    def arm(_: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        rows = rows_of(args)
        if rows > limit and isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(lambda grad: fail(rows))  # type: ignore[no-untyped-call]

    record._handles.append(module.register_forward_pre_hook(check, with_kwargs=True))
    if where == "backward":
        record._handles.append((at or module).register_forward_hook(arm))
    return record


class RankFailed(RuntimeError):
    """A rank of :func:`run_ranks` raised; the message names the rank and the error."""


def run_ranks(
    target: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 120
) -> list[Any]:
    """Run ``target(rank, *args)`` in ``world_size`` fresh processes (daemons) joined in a gloo
    group (a file store, collectives timing out after ``timeout_s`` seconds); the results in rank
    order. ``target``: a module-level function, its result picklable without shared memory
    (``tensor.tolist()``, not tensors). Raises :class:`RankFailed` (the first failing rank), or
    ``queue.Empty`` if no result came within ``2 * timeout_s`` seconds."""
    ctx, ranks = multiprocessing.get_context("spawn"), range(world_size)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = (world_size, os.path.join(tmp, "store"), timeout_s, target, args, queue)
        procs = [ctx.Process(target=_rank_main, args=(r, cfg), daemon=True) for r in ranks]
        try:
            for p in procs:
                p.start()
            results = sorted(queue.get(timeout=2 * timeout_s) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    for _, result in results:
        if isinstance(result, RankFailed):
            raise result
    return [result for _, result in results]


def _rank_main(rank: int, config: tuple[Any, ...]) -> None:
    world_size, store_path, timeout_s, target, args, queue = config
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        queue.put((rank, target(rank, *args)))
    except BaseException as err:  # report it, so the parent does not wait for a result
        queue.put((rank, RankFailed(f"rank {rank}: {type(err).__name__}: {err}")))
        raise
    finally:
        dist.destroy_process_group()

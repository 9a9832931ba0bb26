"""Testing helpers: simulated out-of-memory errors, and gloo process groups, on any machine.

``simulate_oom(module, limit)`` makes ``module`` raise a real ``torch.OutOfMemoryError`` (or
the plain ``RuntimeError`` the CPU allocator raises) whenever a micro-batch of more than
``limit`` rows passes through it: in the forward pass, or in the middle of the backward pass
after the gradients of the layers behind ``at`` were already written. The call installs the
hooks; ``with simulate_oom(module, limit) as sim:`` removes them at the end of the block, or
``sim.remove()`` does. It is how accumopt's OOM recovery is tested without a GPU, and how
``examples/autosize_digits.py`` shows it.

``run_ranks(target, *args)`` runs a function on several CPU processes joined in a gloo
process group (how the DDP and FSDP2 paths are tested and benchmarked on one machine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


@dataclass
class SimulatedOOM:
    """What :func:`simulate_oom` saw, and the handle that removes its hooks.

    Usable as a context manager (the hooks go at the end of the ``with`` block) or by hand
    (call :meth:`remove`). Removing twice is harmless.

    Attributes:
        limit (int): the largest micro-batch that "fits", in rows.
        sizes (list[int]): the rows of every call of the watched module, in order.
        raised (list[int]): the rows of every call that was made to fail, in order.
        active (bool): whether the hooks are still installed.
    """

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


def simulate_oom(
    module: nn.Module,
    limit: int,
    *,
    where: Literal["forward", "backward"] = "forward",
    at: nn.Module | None = None,
    kind: Literal["cuda", "cpu"] = "cuda",
) -> SimulatedOOM:
    """Make ``module`` run out of memory on micro-batches of more than ``limit`` rows.

    The hooks are installed by the call itself and stay until they are removed: use it as a
    context manager, which removes them at the end of the block, or keep the handle and call
    ``.remove()``::

        with simulate_oom(model, 40) as sim:   # hooks removed when the block ends
            runner(batch)

        sim = simulate_oom(model, 40)          # hooks stay until sim.remove()
        runner(batch)
        sim.remove()

    Args:
        module: the module whose calls are watched (the batch size is dim 0 of its first
            tensor argument).
        limit: the largest micro-batch that "fits", in rows (>= 0).
        where: ``"forward"``: raise when ``module`` is called; ``"backward"``: raise during
            the backward pass, when the gradient reaches the output of ``at`` (after the
            gradients of every layer behind it were accumulated into ``.grad``).
        at: the submodule where the backward failure strikes (default: ``module``, i.e.
            before any parameter gradient of ``module`` is written).
        kind: ``"cuda"`` raises ``torch.OutOfMemoryError``; ``"cpu"`` the plain
            ``RuntimeError`` of torch's CPU allocator.

    Returns:
        A :class:`SimulatedOOM`: the record of the sizes seen and the failures raised, and
        the handle that removes the hooks (``.remove()``, or the end of a ``with`` block).

    Raises:
        ValueError: ``where`` or ``kind`` is not one of the values above, or ``limit`` < 0.
    """
    if where not in ("forward", "backward"):
        raise ValueError(f"simulate_oom: where={where!r}; expected 'forward' or 'backward'.")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"simulate_oom: kind={kind!r}; expected 'cuda' or 'cpu'.")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"simulate_oom: limit={limit!r}; expected an int >= 0 (rows).")
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

    record._handles.append(module.register_forward_pre_hook(check, with_kwargs=True))
    if where == "backward":
        record._handles.append((at or module).register_forward_hook(arm))
    return record


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

"""Gradient all-reduces and bytes per real optimizer step under DDP (gloo, 2 processes).

Three loops train the same DDP model with k micro-batches per optimizer step:

- **DDP, sync every micro-step**: the plain hand loop, ``(loss / k).backward()`` per micro-batch;
- **DDP + no_sync by hand**: the same, with ``with model.no_sync():`` around every micro-batch
  but the last of the window (the recommended hand-written pattern);
- **accumopt**: ``Accumulate(opt, every=k, model=ddp)`` and the plain loop.

A DDP communication hook counts the bucket all-reduces and their bytes; the wall time per
optimizer step is the median over the measured windows (gloo on loopback, so it mostly shows
the cost of the collectives on this machine).

Run: ``python bench/communication.py [--windows 20] [--k 8] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import add_json_option, markdown_table, write_json
from torch import nn

from accumopt import Accumulate
from accumopt.testing import run_ranks

WORLD = 2
LOOPS = ("DDP, sync every micro-step", "DDP + no_sync by hand", "accumopt")


def worker(rank: int, loop: str, windows: int, k: int) -> tuple[float, float, float]:
    """One rank: (all-reduces, bytes, median seconds) per optimizer step of ``loop``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 256
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)])
    ddp = nn.parallel.DistributedDataParallel(net)
    stats = {"calls": 0, "bytes": 0}

    def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations
        stats["calls"] += 1
        stats["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # type: ignore[union-attr]
        return fut.then(lambda f: f.value()[0] / WORLD)

    ddp.register_comm_hook(None, counting)
    inner = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    opt = Accumulate(inner, every=k, model=ddp) if loop == "accumopt" else inner
    x, y = torch.randn(32, width), torch.randn(32, width)
    times = []
    for w in range(windows + 1):  # the first window warms up
        dist.barrier()
        start = time.perf_counter()
        for j in range(k):
            last = j == k - 1
            hand_no_sync = loop == LOOPS[1] and not last
            with ddp.no_sync() if hand_no_sync else contextlib.nullcontext():
                loss = ((ddp(x) - y) ** 2).mean()
                if loop == "accumopt":
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    (loss / k).backward()
            if loop != "accumopt" and last:
                inner.step()
                inner.zero_grad()
        times.append(time.perf_counter() - start)
        if w == 0:
            stats = {"calls": 0, "bytes": 0}
    return stats["calls"] / windows, stats["bytes"] / windows, statistics.median(times[1:])


def measure(loop: str, windows: int, k: int) -> dict[str, float]:
    calls, nbytes, seconds = run_ranks(worker, loop, windows, k, world_size=WORLD)[0]
    return {"all_reduces": calls, "mib": nbytes / 2**20, "ms": 1e3 * seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--k", type=int, default=8, help="micro-steps per optimizer step")
    add_json_option(parser)
    args = parser.parse_args(argv)
    results = {loop: measure(loop, args.windows, args.k) for loop in LOOPS}
    rows = [
        [loop, f"{r['all_reduces']:g}", f"{r['mib']:.2f}", f"{r['ms']:.1f}"]
        for loop, r in results.items()
    ]
    markdown = (
        f"DDP over {WORLD} gloo processes, MLP 4 x Linear(256, 256) (1.0 MiB of float32 "
        f"gradients, one bucket), k = {args.k}, {args.windows} measured windows. The counts are "
        "exact; the times are rank 0's wall clock, median over the windows, with the three "
        "loops run one after another (not interleaved, no A/A pair): a rough guide only.\n\n"
        + markdown_table(
            ["loop", "all-reduces per step", "MiB all-reduced per step", "wall ms per step"], rows
        )
    )
    print(markdown)
    data = {"results": results, "markdown": markdown}
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()

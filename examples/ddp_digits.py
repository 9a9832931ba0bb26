"""The digits CNN under DistributedDataParallel with accumulation: one all-reduce per update.

Each rank trains on its own shard of the training set in micro-batches of 32 images; the
window is 8 micro-steps per rank, so with 2 ranks an update sees 512 images. Micro-steps
inside a window skip DDP's all-reduce (accumopt turns DDP's sync flag off and on), item
counts are summed across ranks, and each epoch's partial window is flushed exactly (accumopt
sums it across ranks itself). A DDP communication hook counts DDP's gradient all-reduces, one
per full window; beside them the script reports accumopt's own collectives: one small
all-reduce of the item count per update (``items=`` is summed over the ranks once per window,
which is what makes the update exact) and the flush()es' gradient sums.

Run on CPU with two processes (gloo) from the repository root::

    torchrun --nproc-per-node 2 examples/ddp_digits.py

Started without torchrun, it says so and exits with status 1. Run time: about 15 s on 2 CPU
cores shared with other jobs (one thread per rank, ``--threads 1``, the default).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from accumopt import Accumulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits  # the sibling example: same data, model and optimizer


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--every", type=int, default=8, help="micro-steps per update, per rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads per rank (default 1)"
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("expected --threads >= 1")
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        raise SystemExit(
            "ddp_digits.py trains with DistributedDataParallel and must be started by torchrun, "
            "which starts the processes and tells each its rank. From the repository root:\n"
            "    torchrun --nproc-per-node 2 examples/ddp_digits.py\n"
            "(examples/digits.py is the single-process version.)"
        )
    torch.set_num_threads(args.threads)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts it)
    x_train, y_train, x_test, y_test = digits.load_data()
    model = nn.parallel.DistributedDataParallel(digits.make_model())
    reduces = {"n": 0}

    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads hints
        reduces["n"] += 1
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0] / world)

    model.register_comm_hook(None, counting_allreduce)
    opt = Accumulate(digits.make_optimizer(model, args.lr), every=args.every, model=model)
    shard = torch.arange(rank, len(x_train), world)  # every rank its own images
    # every rank runs the same number of micro-steps (each window ends in collectives)
    steps = (len(x_train) // world) // args.micro_batch
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.epochs):
        order = shard[torch.randperm(len(shard), generator=gen)]
        for i in range(steps):
            idx = order[i * args.micro_batch : (i + 1) * args.micro_batch]
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx], reduction="sum")
            opt.backward(loss, items=len(idx))
            opt.step()
            opt.zero_grad()
        opt.flush()  # the epoch's partial window, on every rank alike (one all-reduce)
    # accumopt's own collectives: the item-count sums (one small all-reduce per update) and
    # each flush()'s gradient sum. A private counter, read defensively.
    own = getattr(getattr(opt, "_ranks", None), "all_reduces", None)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    result: dict[str, Any] = {
        "updates": opt.updates,
        "ddp_all_reduces": reduces["n"],
        "accumopt_collectives": -1 if own is None else own,
        "test_accuracy": accuracy,
    }
    if rank == 0:
        micro_steps = args.epochs * steps
        print(
            f"{world} ranks x {args.every} micro-batches of {args.micro_batch} = effective "
            f"batch {world * args.every * args.micro_batch}; {micro_steps} micro-steps, "
            f"{opt.updates} updates"
        )
        print(
            f"gradient all-reduces by DDP: {reduces['n']} (one per full window; "
            f"{micro_steps} without accumulation)"
        )
        if own is None:
            print("collectives by accumopt: not reported by this accumopt version")
        else:
            print(
                f"collectives by accumopt: {own} (a small item-count all-reduce per update, "
                "and each epoch's flush() of its partial window)"
            )
        print(f"held-out accuracy {accuracy:.4f}")
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()

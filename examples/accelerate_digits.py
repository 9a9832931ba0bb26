"""Train a small MLP on scikit-learn's digits with Hugging Face Accelerate and accumopt.

The 1797 8x8 images of ``sklearn.datasets.load_digits`` (no download) are split 80/20 as in
``digits.py``. Accelerate prepares the model, the ``Accumulate`` wrapper, the data loader and
the LR scheduler in one call of ``accumopt.integrations.accelerate.prepare``; every process
trains on micro-batches of 32 images, 8 micro-steps per update (256 images per process per
update). Each micro-batch announces its image count with ``opt.next_items(n)`` before
``accelerator.backward(loss_sum)``, so the update is the mean over every image of the window,
over all processes; the scheduler (``AcceleratedScheduler``) follows real updates only, and
each epoch's partial window is applied with ``opt.flush()``.

Before training, the script checks on float64 copies that the first window through Accelerate
and ``Accumulate`` gives the same AdamW update as one full-batch step on the window's images
(all processes' images together). With several processes Accelerate wraps the model in DDP and
accumopt synchronises once per update.

Run from the repository root, on one process or two (CPU, gloo)::

    python examples/accelerate_digits.py
    torchrun --nproc-per-node 2 examples/accelerate_digits.py

Run time on 2 CPU cores: about 9 s on one process, about 18 s on two (``--threads 1``);
held-out accuracy about 0.96.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from accumopt import Accumulate
from accumopt.integrations import accelerate as accumopt_accelerate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits  # the sibling example: same data, split and accuracy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--micro-batch", type=int, default=32, help="images per backward pass")
    parser.add_argument("--every", type=int, default=8, help="micro-steps per update")
    parser.add_argument(
        "--lr", type=float, default=1e-2, help="AdamW peak learning rate (OneCycle)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for init and shuffling")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    args = parser.parse_args(argv)
    if min(args.epochs, args.micro_batch, args.every, args.threads) < 1:
        parser.error("expected --epochs, --micro-batch, --every and --threads >= 1")
    return args


def make_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def check_first_window(
    accelerator: Accelerator, model: nn.Module, x: Tensor, y: Tensor, args: argparse.Namespace
) -> tuple[float, float]:
    """One window through Accelerate + Accumulate against one full-batch AdamW step on the
    window's images (of every process), on float64 copies of ``model``.

    Returns:
        The max abs difference of the parameters after the update, and its size relative to
        the full-batch update (||theta - theta_full|| / ||theta_full - theta_0||).
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    window = world * args.every * args.micro_batch  # the first images, in order
    full = copy.deepcopy(model).double()
    theta0 = torch.cat([p.detach().flatten() for p in full.parameters()])
    full_opt = torch.optim.AdamW(full.parameters(), lr=args.lr)
    F.cross_entropy(full(x[:window].double()), y[:window]).backward()
    full_opt.step()

    accum = copy.deepcopy(model).double()
    opt = Accumulate(torch.optim.AdamW(accum.parameters(), lr=args.lr), every=args.every)
    accum, optimizer = accumopt_accelerate.prepare(accelerator, accum, opt)
    batches = x[:window].double().split(args.micro_batch), y[:window].split(args.micro_batch)
    for xb, yb in list(zip(*batches))[rank::world]:  # as Accelerate shards them
        opt.next_items(len(yb))
        accelerator.backward(F.cross_entropy(accum(xb), yb, reduction="sum"))
        optimizer.step()
        optimizer.zero_grad()
    assert opt.updates == 1, "the window should have closed on its last micro-batch"
    theta = torch.cat([p.detach().flatten() for p in accum.parameters()])
    theta_full = torch.cat([p.detach().flatten() for p in full.parameters()])
    rel = float((theta - theta_full).norm() / (theta_full - theta0).norm())
    return float((theta - theta_full).abs().max()), rel


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    accelerator = Accelerator(cpu=True)  # gradient_accumulation_steps=1: Accumulate owns it
    torch.manual_seed(args.seed)  # the same initial model on every process
    x_train, y_train, x_test, y_test = digits.load_data()
    model = make_model()
    max_diff, rel = check_first_window(accelerator, model, x_train, y_train, args)
    accelerator.print(
        f"first window (float64, {accelerator.num_processes} process(es)), Accelerate + "
        f"Accumulate vs one full-batch AdamW step: max |param diff| = {max_diff:.2e}, "
        f"relative to the update = {rel:.2e}"
    )

    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=args.lr), every=args.every)
    windows = -(-len(x_train) // (accelerator.num_processes * args.micro_batch * args.every))
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * windows * accelerator.num_processes
    )
    gen = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train, y_train),
        batch_size=args.micro_batch,
        shuffle=True,
        generator=gen,
    )
    model, optimizer, loader, sched = accumopt_accelerate.prepare(
        accelerator, model, opt, loader, sched
    )
    for epoch in range(args.epochs):
        loss_sum, seen = 0.0, 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y, reduction="sum")
            opt.next_items(len(y))  # this process's images; summed over the processes
            accelerator.backward(loss)
            optimizer.step()  # the inner AdamW steps once per window
            sched.step()  # AcceleratedScheduler: only after a real update
            optimizer.zero_grad()
            loss_sum, seen = loss_sum + loss.item(), seen + len(y)
        if opt.flush():  # the epoch's partial window, exact
            sched.step()
        if epoch % 10 == 9 or epoch == args.epochs - 1:
            accelerator.print(
                f"epoch {epoch + 1}: loss {loss_sum / seen:.3f} (this process's images), "
                f"{opt.updates} updates"
            )

    test_accuracy = digits.accuracy(accelerator.unwrap_model(model), x_test, y_test)
    accelerator.print(f"held-out accuracy: {test_accuracy:.4f}")
    return {
        "first_window_max_abs_diff": max_diff,
        "first_window_rel": rel,
        "updates": opt.updates,
        "test_accuracy": test_accuracy,
    }


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # under torchrun: end the gloo group before exiting
        torch.distributed.destroy_process_group()

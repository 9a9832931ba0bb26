"""Train a small CNN on scikit-learn's handwritten digits with gradient accumulation.

The 1797 8x8 images of ``sklearn.datasets.load_digits`` (shipped with scikit-learn, no
download) are split 80/20, stratified. Training uses an effective batch of 512 images made of
micro-batches of 32 through ``Accumulate(AdamW, every=16)``: one AdamW update per 16 backward
passes. Each micro-batch hands the *sum* of its per-image losses and its image count to
``opt.backward(loss_sum, items=n)``, so the short last micro-batch of an epoch is weighted
exactly, and the epoch's leftover partial window is applied with ``opt.flush()``.

Before training, the script checks on float64 copies of the model that one window through
``Accumulate`` gives the same gradient and the same AdamW update as a single full-batch step
on the window's 512 images.

Run from the repository root::

    python examples/digits.py
    python examples/digits.py --epochs 60 --lr 3e-3

Run time on 2 CPU cores with ``--threads 1`` (the default): about 5 s when the machine is idle,
about 12 s when other jobs share the cores. Two threads are no faster on an idle 2-core
machine and 1.2-7x slower on a busy one (measured 11-82 s), hence the default.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from tqdm import tqdm

from accumopt import Accumulate

Batch = tuple[Tensor, Tensor]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--micro-batch", type=int, default=32, help="images per backward pass")
    parser.add_argument(
        "--effective-batch", type=int, default=512, help="images per optimizer update"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and shuffling")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: 2 are no faster on 2 cores, far slower on busy ones)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("expected --threads >= 1")
    if args.epochs < 1:
        parser.error("expected --epochs >= 1")
    if not 1 <= args.micro_batch <= args.effective_batch or args.effective_batch % args.micro_batch:
        parser.error("expected --effective-batch to be a positive multiple of --micro-batch")
    return args


def load_data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Images (N, 1, 8, 8) scaled to [0, 1] and labels, as a fixed stratified 80/20 split."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0
    )
    return x_train, y_train, x_test, y_test


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def shuffled_batches(x: Tensor, y: Tensor, size: int, gen: torch.Generator) -> list[Batch]:
    """One epoch of micro-batches in random order; the last one may be short."""
    order = torch.randperm(len(x), generator=gen)
    return [(x[i], y[i]) for i in order.split(size)]


def check_first_window(model: nn.Module, window: list[Batch], lr: float) -> tuple[float, float]:
    """Compare one accumulated window with one full-batch step, on float64 copies of ``model``.

    Returns:
        The max abs difference of the gradients, and of the parameters after the AdamW update.
    """
    full = copy.deepcopy(model).double()
    full_opt = make_optimizer(full, lr)
    x = torch.cat([xb for xb, _ in window]).double()
    y = torch.cat([yb for _, yb in window])
    F.cross_entropy(full(x), y).backward()
    full_opt.step()

    accum = copy.deepcopy(model).double()
    opt = Accumulate(make_optimizer(accum, lr), every=len(window))
    for xb, yb in window:
        opt.backward(F.cross_entropy(accum(xb.double()), yb, reduction="sum"), items=len(yb))
        opt.step()
    assert opt.did_update, "the window should have closed on its last micro-batch"

    pairs = list(zip(full.parameters(), accum.parameters()))
    grad_diff = max((a.grad - b.grad).abs().max().item() for a, b in pairs)  # type: ignore[operator]
    param_diff = max((a - b).abs().max().item() for a, b in pairs)
    return grad_diff, param_diff


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    every = args.effective_batch // args.micro_batch
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data()
    model = make_model()
    gen = torch.Generator().manual_seed(args.seed)
    epochs = [shuffled_batches(x_train, y_train, args.micro_batch, gen) for _ in range(args.epochs)]
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images; micro-batch "
        f"{args.micro_batch} x {every} = effective batch {args.effective_batch}"
    )

    window = epochs[0][:every]
    grad_diff, param_diff = check_first_window(model, window, args.lr)
    print(
        f"first window (float64), Accumulate vs one full-batch step on "
        f"{sum(len(y) for _, y in window)} images: max |grad diff| = {grad_diff:.2e}, "
        f"max |param diff| after AdamW = {param_diff:.2e}"
    )

    opt = Accumulate(make_optimizer(model, args.lr), every=every, model=model)
    bar = tqdm(epochs, desc="epochs", unit="epoch")
    for batches in bar:
        loss_sum = 0.0
        for x, y in batches:
            loss = F.cross_entropy(model(x), y, reduction="sum")
            opt.backward(loss, items=len(y))
            opt.step()
            opt.zero_grad()
            loss_sum += loss.item()
        opt.flush()
        bar.set_postfix(loss=f"{loss_sum / len(x_train):.3f}", updates=opt.updates)

    test_accuracy = accuracy(model, x_test, y_test)
    print(f"updates: {opt.updates} over {args.epochs} epochs")
    print(f"held-out accuracy: {test_accuracy:.4f}")
    return {
        "test_accuracy": test_accuracy,
        "first_window_max_abs_diff": param_diff,
        "first_window_grad_max_abs_diff": grad_diff,
        "updates": opt.updates,
    }


if __name__ == "__main__":
    main()

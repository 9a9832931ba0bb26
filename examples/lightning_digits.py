"""Train a small MLP on scikit-learn's handwritten digits with Lightning and accumopt.

The 1797 8x8 images of ``sklearn.datasets.load_digits`` (shipped with scikit-learn, no
download) are split 80/20, stratified. A ``LightningModule`` returns
``Accumulate(AdamW, every=16)`` from ``configure_optimizers`` and the ``Trainer`` gets
``AccumulateCallback()``: micro-batches of 32 images make an effective batch of 512, one AdamW
update per 16 ``training_step`` calls. ``training_step`` returns the *summed* loss through
``loss_over_items``, so the short last micro-batch of an epoch (29 images) is weighted by its
images, and the epoch's short last window (13 micro-batches) is applied at the epoch's end.
``gradient_clip_val`` clips each window's mean gradient once, and the cosine LR schedule
(``interval="step"``) and ``trainer.global_step`` count real updates.

Before training, the script checks on float64 copies of the model that one window trained by
Lightning through ``Accumulate`` gives the same parameters as Lightning's single full-batch
step on the window's 512 images, without accumulation (clipping and schedule included).

Run from the repository root::

    python examples/lightning_digits.py
    python examples/lightning_digits.py --epochs 60 --lr 3e-3
    torchrun --nproc-per-node 2 examples/lightning_digits.py   # DDP on gloo, 2 processes

Run time on 2 CPU cores with ``--threads 1`` (the default): about 10 s when the machine is idle
(importing Lightning takes a few of them).
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from accumopt import Accumulate
from accumopt.integrations.lightning import AccumulateCallback, loss_over_items

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits  # the sibling example: same data, split and accuracy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    parser.add_argument("--micro-batch", type=int, default=32, help="images per backward pass")
    parser.add_argument(
        "--effective-batch", type=int, default=512, help="images per optimizer update"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW peak learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (2-norm)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and shuffling")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.epochs < 1:
        parser.error("expected --threads >= 1 and --epochs >= 1")
    share = args.micro_batch * int(os.environ.get("WORLD_SIZE", "1"))  # one micro-batch a rank
    if not 1 <= share <= args.effective_batch or args.effective_batch % share:
        parser.error(
            "expected --effective-batch to be a positive multiple of --micro-batch times the "
            "number of processes"
        )
    return args


def load_data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sibling example's split, images flattened to (N, 64) for an MLP."""
    x_train, y_train, x_test, y_test = digits.load_data()
    return x_train.flatten(1), y_train, x_test.flatten(1), y_test


class DigitsMLP(L.LightningModule):
    """64 -> 128 -> 10 MLP. ``every=None`` trains without accumulation (the reference)."""

    def __init__(self, lr: float, every: int | None, total_updates: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr, self.every, self.total_updates = lr, every, total_updates

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss_sum = F.cross_entropy(self(x), y, reduction="sum")
        return loss_over_items(self, loss_sum, len(y))  # the sum with Accumulate, else the mean

    def configure_optimizers(self) -> Any:
        opt: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if self.every is not None:
            opt = Accumulate(opt, every=self.every)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_updates)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: DDP on gloo, one rank each
RANK = int(os.environ.get("RANK", "0"))


def trainer(
    max_epochs: int = -1, max_steps: int = -1, clip: float = 1.0, accumulate: bool = True
) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy="ddp" if WORLD > 1 else "auto",
        max_epochs=max_epochs,
        max_steps=max_steps,
        gradient_clip_val=clip,
        callbacks=[AccumulateCallback()] if accumulate else None,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )


def check_first_window(model: DigitsMLP, x: Tensor, y: Tensor, args: argparse.Namespace) -> float:
    """Train float64 copies of ``model`` by Lightning for one update: through Accumulate on
    micro-batches, and without accumulation on the whole window (under DDP each rank takes its
    share of the window). Returns ||theta_acc - theta_full|| / ||theta_full - theta_0||."""
    every = args.effective_batch // (args.micro_batch * WORLD)
    window = TensorDataset(x[: args.effective_batch].double(), y[: args.effective_batch])
    start = copy.deepcopy(model).double()
    accumulated, full = copy.deepcopy(start), copy.deepcopy(start)
    accumulated.every, full.every = every, None
    trainer(max_steps=1, clip=args.clip).fit(accumulated, DataLoader(window, args.micro_batch))
    trainer(max_steps=1, clip=args.clip, accumulate=False).fit(
        full, DataLoader(window, args.effective_batch // WORLD)
    )
    vec = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (start, full)]
    got = torch.cat([p.detach().flatten() for p in accumulated.parameters()])
    return ((got - vec[1]).norm() / (vec[1] - vec[0]).norm()).item()


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=PossibleUserWarning)  # num_workers=0 is fine here
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated")  # Lightning on torch
    every = args.effective_batch // (args.micro_batch * WORLD)  # micro-batches per rank
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data()
    batches = math.ceil(len(x_train) / (args.micro_batch * WORLD))
    total = math.ceil(batches / every) * args.epochs  # updates: each epoch ends with a flush
    model = DigitsMLP(args.lr, every, total)
    show = print if RANK == 0 else (lambda *_: None)
    show(
        f"digits: {len(x_train)} train / {len(x_test)} test images; micro-batch "
        f"{args.micro_batch} x {every} x {WORLD} rank(s) = effective batch {args.effective_batch}"
    )

    first_rel = check_first_window(model, x_train, y_train, args)
    show(
        f"first window (float64), Lightning + Accumulate vs Lightning's full-batch step on "
        f"{args.effective_batch} images: rel param diff = {first_rel:.2e}"
    )

    gen = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        TensorDataset(x_train, y_train), batch_size=args.micro_batch, shuffle=True, generator=gen
    )
    fitted = trainer(max_epochs=args.epochs, clip=args.clip)
    fitted.fit(model, loader)
    opt = fitted.optimizers[0]
    assert isinstance(opt, Accumulate)
    test_accuracy = digits.accuracy(model.eval(), x_test, y_test)
    show(
        f"updates: {opt.updates} over {args.epochs} epochs (trainer.global_step "
        f"{fitted.global_step}); last lr {opt.param_groups[0]['lr']:.2e}"
    )
    show(f"held-out accuracy: {test_accuracy:.4f}")
    return {
        "test_accuracy": test_accuracy,
        "first_window_rel": first_rel,
        "updates": opt.updates,
        "global_step": fitted.global_step,
    }


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # under torchrun: end the gloo group before exiting
        torch.distributed.destroy_process_group()

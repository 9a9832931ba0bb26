"""Train the digits CNN at a fixed effective batch with ``micro_batch_size="auto"``.

The model, data split and optimizer are those of ``examples/digits.py``. Each training step
takes a batch of 512 images (a host tensor) and hands it to
``MicroBatchRunner(Accumulate(AdamW, every_items=512), loss_fn, micro_batch_size="auto")``: the
runner first tries the whole batch as one micro-batch and, on an out-of-memory error, rolls back
the failed micro-batch alone and retries smaller, bisecting towards the largest size that fits;
the window in items keeps the effective batch at 512 whatever the micro-batch size. The epoch's
short last batch leaves a partial window, applied exactly with ``opt.flush()``.

A CPU has memory to spare for this model, so ``--memory-limit N`` imposes a simulated limit
with ``accumopt.testing.simulate_oom``: a micro-batch of more than N images raises a real
``torch.OutOfMemoryError`` in the middle of its backward pass, after the gradients of every
layer past the first convolution were already written. The ``accumopt`` logger reports each
failure and size change, so the back-off is visible in the log.

With ``--compare`` (the default) the script first trains twice from the same seed, in float64
for a short run, without the limit (one micro-batch of 512) and with it, and prints the largest
parameter difference between the two: about 1e-15, because the recovery loses and
double-counts nothing. Then it trains the float32 model under the limit and reports the size
the search settled on, the OOMs it recovered from, and the held-out accuracy. (After 1000
clean micro-steps the runner probes a larger size once, ``grow_after``, so late in the main
run a few more OOMs appear and the search settles again.)

Run from the repository root::

    python examples/autosize_digits.py
    python examples/autosize_digits.py --memory-limit 100 --no-compare
    python examples/autosize_digits.py --memory-limit 0   # no limit: one micro-batch per step

Run time: about 30 s on 2 CPU cores shared with other jobs, ``--threads 1`` (the default;
90 s with 2 threads on the same busy cores).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Hashable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from accumopt import Accumulate, MicroBatchRunner
from accumopt.testing import simulate_oom

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # so that the sibling example imports when loaded by path
    sys.path.insert(0, str(HERE))
import digits  # noqa: E402  (examples/digits.py: data, model, optimizer, accuracy)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="passes of the main run")
    parser.add_argument(
        "--batch", type=int, default=512, help="images per step = per optimizer update"
    )
    parser.add_argument(
        "--memory-limit",
        type=int,
        default=40,
        metavar="N",
        help="simulated limit: micro-batches of more than N images run out of memory (0: none)",
    )
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first compare float64 runs with and without the limit",
    )
    parser.add_argument("--compare-epochs", type=int, default=2, help="passes of each run")
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
    if args.epochs < 1 or args.compare_epochs < 1:
        parser.error("expected --epochs >= 1 and --compare-epochs >= 1")
    if args.batch < 1:
        parser.error("expected --batch >= 1")
    if args.memory_limit < 0:
        parser.error("expected --memory-limit >= 0 (0: no limit)")
    if args.compare and args.memory_limit == 0:
        parser.error("--compare compares runs with and without --memory-limit; give N >= 1")
    return args


def memory_limit(model: nn.Module, limit: int) -> AbstractContextManager[Any]:
    """Micro-batches of more than ``limit`` images fail mid-backward (0: no limit)."""
    if limit == 0:
        return nullcontext()
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    return simulate_oom(model, limit, where="backward", at=first_conv)


def train(
    x_train: Tensor,
    y_train: Tensor,
    args: argparse.Namespace,
    *,
    epochs: int,
    limit: int,
    dtype: torch.dtype,
    desc: str,
) -> tuple[nn.Module, MicroBatchRunner, Accumulate]:
    """Train a fresh model (seeded init and shuffling) with the auto-sizing runner."""
    torch.manual_seed(args.seed)
    model = digits.make_model().to(dtype)
    x_train = x_train.to(dtype)
    opt = Accumulate(digits.make_optimizer(model, args.lr), every_items=args.batch, model=model)

    def loss_fn(batch: tuple[Tensor, Tensor]) -> Tensor:  # the micro-batch's mean loss
        x, y = batch
        return F.cross_entropy(model(x), y)

    runner = MicroBatchRunner(opt, loss_fn, micro_batch_size="auto", loss_reduction="mean")
    gen = torch.Generator().manual_seed(args.seed)
    with memory_limit(model, limit), logging_redirect_tqdm():
        bar = tqdm(range(epochs), desc=desc, unit="epoch")
        for _ in bar:
            loss_sum = 0.0
            for x, y in digits.shuffled_batches(x_train, y_train, args.batch, gen):
                loss_sum += runner((x, y)).item() * len(y)
            opt.flush()  # the short last batch's partial window
            bar.set_postfix(
                loss=f"{loss_sum / len(x_train):.3f}",
                micro=runner.micro_batch_size,
                ooms=runner.ooms,
                updates=opt.updates,
            )
    return model, runner, opt


def compact_history(history: list[tuple[Hashable, int, str]], head: int = 12) -> str:
    """``runner.history`` as ``512 (first), 256 (smaller), ...``, cut after ``head`` entries."""
    text = ", ".join(f"{size} ({reason})" for _, size, reason in history[:head])
    return text + (f", ... {len(history) - head} more" if len(history) > head else "")


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the comparison (unless ``--no-compare``) and the main run.

    Returns:
        ``micro_batch_size``, ``ooms``, ``updates`` and ``test_accuracy`` of the main run and,
        with ``--compare``, ``max_abs_param_diff`` and ``compare_ooms``.
    """
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)-7s %(name)s | %(message)s")
    x_train, y_train, x_test, y_test = digits.load_data()
    limit_text = (
        f"simulated memory limit {args.memory_limit} images"
        if args.memory_limit
        else "no simulated memory limit"
    )
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images; effective batch "
        f"{args.batch}, micro-batch size 'auto', {limit_text}"
    )
    result: dict[str, float] = {}

    if args.compare:
        print(f"compare (float64, {args.compare_epochs} epochs): without the limit, then with it")
        kwargs: dict[str, Any] = {"epochs": args.compare_epochs, "dtype": torch.float64}
        free, free_runner, _ = train(x_train, y_train, args, limit=0, desc="no limit", **kwargs)
        limited, runner, _ = train(
            x_train, y_train, args, limit=args.memory_limit, desc="limited", **kwargs
        )
        diff = max_abs_diff(free, limited)
        print(
            f"  no limit: micro-batch {free_runner.micro_batch_size}, {free_runner.ooms} OOMs; "
            f"limit {args.memory_limit}: micro-batch {runner.micro_batch_size}, "
            f"{runner.ooms} OOMs recovered"
        )
        print(f"  max |param diff| between the two runs: {diff:.2e}")
        result.update(max_abs_param_diff=diff, compare_ooms=runner.ooms)

    print(f"main run (float32, {args.epochs} epochs, {limit_text})")
    model, runner, opt = train(
        x_train,
        y_train,
        args,
        epochs=args.epochs,
        limit=args.memory_limit,
        dtype=torch.float32,
        desc="main",
    )
    test_accuracy = digits.accuracy(model, x_test, y_test)
    print(f"micro-batch size found (runner.micro_batch_size): {runner.micro_batch_size}")
    print(f"OOMs recovered (runner.ooms): {runner.ooms}")
    print(f"runner.history ({len(runner.history)} size changes): {compact_history(runner.history)}")
    print(f"updates: {opt.updates} over {args.epochs} epochs")
    print(f"held-out accuracy: {test_accuracy:.4f}")
    result.update(
        micro_batch_size=runner.micro_batch_size or 0,
        ooms=runner.ooms,
        updates=opt.updates,
        test_accuracy=test_accuracy,
    )
    return result


if __name__ == "__main__":
    main()

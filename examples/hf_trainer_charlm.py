"""A tiny GPT-2 on CPython's own documentation, trained by the Hugging Face Trainer with
``Accumulate`` through :class:`accumopt.integrations.hf_trainer.AccumulateTrainer`.

The text is ``pydoc_data.topics`` (shipped with Python, no download), cut into sequences of 8
to 64 characters; the model is a 2-layer GPT-2 built from a config (no weights downloaded)
with one token per character. Batches are padded to their longest sequence, so micro-batches
hold very different numbers of tokens: the Trainer's loop accumulates ``--every`` micro-batches
of ``--micro-batch`` sequences per update, and each update is the mean over every token of the
window (not the mean of micro-batch means).

First, in float64, the script runs the first window twice: once through ``AccumulateTrainer``
(``--every`` micro-batches) and once through the plain ``Trainer`` with the whole window as
one batch, and prints how far apart the two updated models are. Then it trains in float32
with AdamW and a cosine schedule (both counted in real updates) and prints the loss.

Run from the repository root::

    python examples/hf_trainer_charlm.py
    python examples/hf_trainer_charlm.py --steps 100 --every 4
    torchrun --nproc-per-node 2 examples/hf_trainer_charlm.py   # DDP on gloo, 2 processes

Run time: about 20 s on 2 CPU cores (``--threads 1``, the default), most of it importing
transformers.
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
from pydoc_data.topics import topics
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

from accumopt import Accumulate
from accumopt.integrations.hf_trainer import AccumulateTrainer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer updates to train")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per backward pass")
    parser.add_argument("--every", type=int, default=8, help="micro-batches per update")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and shuffling")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if min(args.steps, args.micro_batch, args.every, args.threads) < 1:
        parser.error("expected --steps, --micro-batch, --every, --threads >= 1")
    return args


def char_dataset() -> tuple[list[str], list[dict[str, list[int]]]]:
    """The vocabulary (id 0 pads) and sequences of 8..64 character ids, as Trainer examples."""
    text = "\n\n".join(topics.values())
    vocab = sorted(set(text))
    ids = {c: i + 1 for i, c in enumerate(vocab)}
    examples = []
    for paragraph in text.split("\n\n"):
        for start in range(0, len(paragraph), 64):
            piece = paragraph[start : start + 64]
            if len(piece) >= 8:
                seq = [ids[c] for c in piece]
                examples.append({"input_ids": seq, "labels": seq})  # the model shifts labels
    return vocab, examples


def collate(features: list[dict[str, list[int]]]) -> dict[str, Tensor]:
    """Right-pad to the longest sequence of the batch; padding gets label -100 (no loss)."""
    width = max(len(f["input_ids"]) for f in features)
    batch = {
        "input_ids": torch.zeros(len(features), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(features), width, dtype=torch.long),
        "labels": torch.full((len(features), width), -100, dtype=torch.long),
    }
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        batch["input_ids"][row, :n] = torch.tensor(f["input_ids"])
        batch["attention_mask"][row, :n] = 1
        batch["labels"][row, :n] = torch.tensor(f["labels"])
    return batch


def f64_causal_loss(
    logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Any = None, **_: Any
) -> Tensor:
    """GPT-2's causal LM loss without its float32 upcast (for the float64 check only)."""
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    flat_logits, flat_targets = logits.reshape(-1, vocab_size), targets.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(flat_logits, flat_targets, ignore_index=-100)
    loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=-100, reduction="sum")
    return loss_sum / num_items_in_batch


def tiny_gpt2(vocab_size: int, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size + 1,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # so that the plain Trainer counts shifted tokens too
    return model


def trainer_args(out: str, micro_batch: int, **kwargs: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        per_device_train_batch_size=micro_batch,
        **kwargs,
    )


def first_window_rel(model: GPT2LMHeadModel, data: list[Any], args: argparse.Namespace) -> float:
    """||theta_acc - theta_full|| / ||theta_full - theta_0|| after one update, in float64."""
    base = copy.deepcopy(model).double()
    base.loss_function = f64_causal_loss
    theta0 = torch.cat([p.detach().flatten() for p in base.parameters()])
    models = []
    with tempfile.TemporaryDirectory() as out:
        for accumulate in (True, False):
            m = copy.deepcopy(base)
            sgd = torch.optim.SGD(m.parameters(), lr=1.0)
            kw = {"max_steps": 1, "seed": args.seed, "max_grad_norm": 0.0}
            if accumulate:  # --every micro-batches of --micro-batch sequences
                opt = Accumulate(sgd, every=args.every)
                run: Trainer = AccumulateTrainer(
                    model=m,
                    args=trainer_args(out, args.micro_batch, **kw),
                    train_dataset=data,
                    data_collator=collate,
                    optimizers=(opt, None),
                )
            else:  # the whole window as one batch
                run = Trainer(
                    model=m,
                    args=trainer_args(out, args.micro_batch * args.every, **kw),
                    train_dataset=data,
                    data_collator=collate,
                    optimizers=(sgd, None),
                )
            run.remove_callback(PrinterCallback)  # no log lines for the check
            run.train()
            models.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    return float((models[0] - models[1]).norm() / (models[1] - theta0).norm())


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab, data = char_dataset()
    model = tiny_gpt2(len(vocab), args.seed)
    print(
        f"text: {len(data)} sequences, {len(vocab)} characters; model: "
        f"{sum(p.numel() for p in model.parameters())} parameters"
    )
    rel = first_window_rel(model, data, args)
    print(f"first window (float64): |theta_acc - theta_full| / |theta_full - theta_0| = {rel:.1e}")

    # --- the recipe: Accumulate as the Trainer's optimizer, through AccumulateTrainer --------
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=args.lr), every=args.every)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.micro_batch,  # the micro-batch
            max_steps=args.steps,  # real updates, like warmup, logging and saving steps
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.steps // 10),
            logging_steps=max(1, args.steps // 8),
            max_grad_norm=1.0,  # clips the window's gradient, once per update
            seed=args.seed,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            save_strategy="no",
        )
        trainer = AccumulateTrainer(
            model=model,
            args=training_args,  # gradient_accumulation_steps: taken from opt.every
            train_dataset=data,
            data_collator=collate,  # pads each micro-batch; padding labels -100 carry no loss
            optimizers=(opt, None),  # None: the Trainer's own scheduler, over real updates
        )
        trainer.train()  # each update: the mean over every token of its micro-batches
    losses = [h["loss"] / math.log(2) for h in trainer.state.log_history if "loss" in h]
    print(f"{opt.updates} updates of {args.every} x {args.micro_batch} sequences; training loss:")
    print(f"{losses[0]:.3f} -> {losses[-1]:.3f} bits/char")
    return {
        "first_window_rel": rel,
        "updates": float(opt.updates),
        "first_loss": losses[0],  # bits/char
        "last_loss": losses[-1],
    }


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # under torchrun: end the gloo group before exiting
        torch.distributed.destroy_process_group()

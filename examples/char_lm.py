"""Token-weighted gradient accumulation for a tiny character-level transformer.

The text is CPython's own documentation, ``pydoc_data.topics`` (shipped with Python, no
download), cut into paragraphs and then into sequences of 8 to 128 characters. Micro-batches
are length-bucketed (sequences of similar length are padded together, as LM pipelines do to
save padding), so their token counts differ widely within a window.

First, on one window of micro-batches in float64, the script measures how far two ways of
accumulating land from the full-batch gradient (the mean over all non-pad tokens of the
window, from one backward pass over the whole window padded into one batch):

(a) uniform averaging: ``loss_mean.backward()`` per micro-batch, averaged over the window by
    ``Accumulate(..., every=k)``: every micro-batch weighs the same, whatever its token count;
(b) token weighting: ``opt.backward(loss_sum, items=n_tokens)``: the window's summed gradient is
    divided once by the window's total token count, which is exact.

Then it trains briefly with ``Accumulate(AdamW, every_items=2048)``: one update per 2048 target
tokens, however many micro-batches that takes. It prints the training loss in bits per
character and samples some text.

Run from the repository root::

    python examples/char_lm.py
    python examples/char_lm.py --steps 200 --temperature 0

Run time: about 35 s on 2 CPU cores shared with other jobs, ``--threads 1`` (the default; with
2 threads on the same busy cores it had not finished after 7 minutes).
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Iterator
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from accumopt import Accumulate

PAD = 0  # pad id; characters get ids 1..len(vocab)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="optimizer updates to train")
    parser.add_argument("--seed", type=int, default=0, help="seed for init, batching, sampling")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument(
        "--tokens-per-update", type=int, default=2048, help="target tokens per update"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate")
    parser.add_argument("--max-len", type=int, default=128, help="longest sequence (chars)")
    parser.add_argument("--min-len", type=int, default=8, help="shortest sequence (chars)")
    parser.add_argument(
        "--compare-k", type=int, default=8, help="micro-batches in the comparison window"
    )
    parser.add_argument("--sample-len", type=int, default=300, help="characters to generate")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy"
    )
    parser.add_argument("--prompt", default="The ", help="text to start the sample with")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: 2 are no faster on 2 cores, far slower on busy ones)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("expected --threads >= 1")
    if not 1 <= args.min_len <= args.max_len:
        parser.error("expected 1 <= --min-len <= --max-len")
    if min(args.steps, args.batch_size, args.tokens_per_update, args.compare_k) < 1:
        parser.error("expected --steps, --batch-size, --tokens-per-update, --compare-k >= 1")
    return args


def load_chunks(min_len: int, max_len: int) -> tuple[list[str], list[Tensor]]:
    """The vocabulary and the sequences (ids), ``min_len``..``max_len`` next-char targets each."""
    text = "\n\n".join(topics.values())
    vocab = sorted(set(text))
    ids = {c: i + 1 for i, c in enumerate(vocab)}
    chunks = []
    for paragraph in text.split("\n\n"):
        for start in range(0, len(paragraph), max_len + 1):
            piece = paragraph[start : start + max_len + 1]
            if len(piece) > min_len:
                chunks.append(torch.tensor([ids[c] for c in piece]))
    return vocab, chunks


def bucketed_batches(chunks: list[Tensor], size: int, gen: torch.Generator) -> list[list[Tensor]]:
    """One epoch of micro-batches of similar-length sequences, in random order."""
    shuffled = [chunks[i] for i in torch.randperm(len(chunks), generator=gen)]
    by_length = sorted(shuffled, key=len)
    batches = [by_length[i : i + size] for i in range(0, len(by_length), size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen)]


def micro_batches(chunks: list[Tensor], size: int, gen: torch.Generator) -> Iterator[list[Tensor]]:
    """Endless length-bucketed micro-batches, epoch after epoch."""
    while True:
        yield from bucketed_batches(chunks, size, gen)


def collate(seqs: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Inputs and next-char targets, right-padded with ``PAD``."""
    inputs = pad_sequence([s[:-1] for s in seqs], batch_first=True, padding_value=PAD)
    targets = pad_sequence([s[1:] for s in seqs], batch_first=True, padding_value=PAD)
    return inputs, targets


class CharTransformer(nn.Module):
    """A causal transformer over characters: embeddings, 2 pre-norm layers, a linear head."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size + 1, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            nhead=4,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size + 1)

    def forward(self, ids: Tensor) -> Tensor:
        length = ids.shape[1]
        # Right padding needs no key mask under a causal mask: a real position only attends
        # to earlier positions, which are real too.
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).triu(1)
        h = self.embed(ids) + self.pos(torch.arange(length, device=ids.device))
        h = self.encoder(h, mask=causal, is_causal=True)
        return self.head(self.norm(h))


def loss_sum(model: nn.Module, inputs: Tensor, targets: Tensor) -> tuple[Tensor, int]:
    """Summed cross-entropy over the non-pad targets, and how many there are."""
    logits = model(inputs)
    loss = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=PAD, reduction="sum"
    )
    return loss, int((targets != PAD).sum())


def flat_grad(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]


def accumulated_grad(model: nn.Module, window: list[list[Tensor]], weighted: bool) -> Tensor:
    """The gradient ``.grad`` holds after the window's last backward, before ``step()``."""
    opt = Accumulate(torch.optim.AdamW(model.parameters()), every=len(window))
    for seqs in window:
        loss, n = loss_sum(model, *collate(seqs))
        if weighted:
            opt.backward(loss, items=n)
        else:
            (loss / n).backward()
        if opt.will_update:
            break
        opt.step()
        opt.zero_grad()
    assert opt.will_update, "the window should close on its last micro-batch"
    grad = flat_grad(model)
    opt.discard()  # measured, not applied
    return grad


def compare_window(model: nn.Module, window: list[list[Tensor]]) -> tuple[float, float]:
    """Relative L2 errors of uniform and token-weighted accumulation, on float64 copies."""
    reference = copy.deepcopy(model).double()
    loss, n = loss_sum(reference, *collate([s for seqs in window for s in seqs]))
    (loss / n).backward()
    g_ref = flat_grad(reference)
    errors = []
    for weighted in (False, True):
        g = accumulated_grad(copy.deepcopy(model).double(), window, weighted)
        errors.append(((g - g_ref).norm() / g_ref.norm()).item())
    return errors[0], errors[1]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    length: int,
    max_len: int,
    temperature: float,
    gen: torch.Generator,
) -> list[int]:
    ids = list(prompt)
    for _ in range(length):
        logits = model(torch.tensor([ids[-max_len:]]))[0, -1]
        logits[PAD] = -math.inf
        if temperature > 0:
            probs = F.softmax(logits / temperature, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
        else:
            ids.append(int(logits.argmax()))
    return ids


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    vocab, chunks = load_chunks(args.min_len, args.max_len)
    ids = {c: i + 1 for i, c in enumerate(vocab)}
    unknown = set(args.prompt) - set(ids)
    if unknown:
        raise SystemExit(f"--prompt has characters not in the text: {sorted(unknown)}")
    model = CharTransformer(len(vocab), args.max_len)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"text: {len(chunks)} sequences, vocabulary {len(vocab)}; model: {n_params} parameters")

    # The comparison window is the first micro-batches of the training stream (same seed).
    first = bucketed_batches(chunks, args.batch_size, torch.Generator().manual_seed(args.seed))
    window = first[: args.compare_k]
    tokens = [sum(len(s) - 1 for s in seqs) for seqs in window]
    uniform_err, weighted_err = compare_window(model, window)
    print(f"window of {len(window)} micro-batches with {tokens} target tokens (float64),")
    print("relative L2 error of the accumulated gradient vs the full-batch token mean:")
    print(f"  (a) uniform averaging, loss_mean.backward(): {uniform_err:.2e}")
    print(f"  (b) token-weighted, opt.backward(loss_sum, items=n): {weighted_err:.2e}")

    opt = Accumulate(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        every_items=args.tokens_per_update,
        max_grad_norm=1.0,
    )
    # Cosine decay, stepped once per real update (not per micro-batch).
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=args.steps, eta_min=args.lr / 10
    )
    stream = micro_batches(chunks, args.batch_size, torch.Generator().manual_seed(args.seed))
    log_every = max(1, args.steps // 10)
    history: list[float] = []  # bits/char over each stretch of log_every updates
    start, nats, n_tokens = 1, 0.0, 0
    with tqdm(total=args.steps, desc="training", unit="update") as bar:
        while opt.updates < args.steps:
            loss, n = loss_sum(model, *collate(next(stream)))
            opt.backward(loss, items=n)
            opt.step()
            opt.zero_grad()
            nats, n_tokens = nats + loss.item(), n_tokens + n
            if not opt.did_update:
                continue
            schedule.step()
            bar.update()
            bits = nats / n_tokens / math.log(2)
            bar.set_postfix(bpc=f"{bits:.3f}")
            if opt.updates % log_every == 0 or opt.updates == args.steps:
                history.append(bits)
                tqdm.write(f"updates {start:4d}-{opt.updates:4d}: {bits:.3f} bits/char")
                start, nats, n_tokens = opt.updates + 1, 0.0, 0

    sample = generate(
        model,
        [ids[c] for c in args.prompt],
        args.sample_len,
        args.max_len,
        args.temperature,
        torch.Generator().manual_seed(args.seed),
    )
    print(f"training loss: {history[0]:.3f} -> {history[-1]:.3f} bits/char")
    print(f"sample (temperature {args.temperature:g}):")
    print("".join(vocab[i - 1] for i in sample))
    return {
        "uniform_rel_err": uniform_err,
        "token_weighted_rel_err": weighted_err,
        "first_loss": history[0],
        "last_loss": history[-1],
    }


if __name__ == "__main__":
    main()

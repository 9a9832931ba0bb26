"""Peak memory (process peak RSS, CPU) of an effective batch done at once or in micro-batches.

A small conv net on 28x28 single-channel inputs (three 3x3 conv layers, two max-pools, one linear
layer: activations dominate, parameters are 0.2 MiB) takes one plain SGD step on an effective
batch of 4096 samples:

- **one batch of 4096**: a single forward/backward;
- **accumopt, 128 x 32**: ``Accumulate(SGD, every=128)``, ``loss.backward(); opt.step();
  opt.zero_grad()`` on each of 128 micro-batches of 32;
- **hand loop, 128 x 32**: ``(loss / 128).backward()`` per micro-batch, then step and zero;
- **mbp-pytorch, 128 x 32**: one ``@mbp.apply(..., ub_size=32)`` call on the 4096 rows, then step;

against the reference **plain batch 32**: one step on the first 32 samples. Every configuration
holds the same 4096 samples in memory (12.3 MiB), so the differences are activations, and reports
the norm of its parameter update divided by the learning rate, i.e. the gradient norm: the four
4096-sample configurations must agree on it. Two rows give the floor: a bare interpreter and a
child that imports torch and builds the data and the model but takes no step.

Each configuration runs in fresh child processes (``python bench/memory.py --child NAME``, three
per configuration by default, round-robin; the table gives the median and the range), whose peak
RSS the parent reads with ``os.wait4`` on that child's pid. The parent imports no torch and
stays small on purpose: Linux carries the peak RSS of the address space a process leaves at
``exec`` into its ``ru_maxrss``, and a child started with ``vfork``/``fork`` leaves its parent's.

Run: ``python bench/memory.py [--children 3] [--threads 1] [--json PATH]``.
"""

from __future__ import annotations

from typing import Any

import _children
from _children import BARE
from _common import available, markdown_table

EFFECTIVE = 4096
MICRO = 32
LR = 0.1
NO_STEP = "torch + data + model, no step"
REFERENCE = "plain batch 32"
CONFIGS = [
    BARE,
    NO_STEP,
    REFERENCE,
    "one batch of 4096",
    "accumopt, 128 x 32",
    "hand loop, 128 x 32",
    "mbp-pytorch, 128 x 32",
]


def child(config: str, threads: int) -> dict[str, float]:
    """Run ``config`` in this (fresh) process; return the gradient norm its update implies."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    x = torch.randn(EFFECTIVE, 1, 28, 28)
    y = torch.randint(0, 10, (EFFECTIVE,))
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 10),
    )
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    micro = list(zip(x.split(MICRO), y.split(MICRO)))

    if config == NO_STEP:
        return {}
    if config == REFERENCE:
        F.cross_entropy(model(x[:MICRO]), y[:MICRO]).backward()
        opt.step()
    elif config == "one batch of 4096":
        F.cross_entropy(model(x), y).backward()
        opt.step()
    elif config == "accumopt, 128 x 32":
        from accumopt import Accumulate

        acc = Accumulate(opt, every=len(micro))
        for xb, yb in micro:
            F.cross_entropy(model(xb), yb).backward()
            acc.step()
            acc.zero_grad()
    elif config == "hand loop, 128 x 32":
        for xb, yb in micro:
            (F.cross_entropy(model(xb), yb) / len(micro)).backward()
        opt.step()
    elif config == "mbp-pytorch, 128 x 32":
        import mbp

        @mbp.apply(["xs", "ys"], ub_size=MICRO)
        def train_fn(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(xs), ys)

        train_fn(xs=x, ys=y)
        opt.step()
    else:
        raise ValueError(f"unknown configuration {config!r}; expected one of {CONFIGS}")
    opt.zero_grad()
    step = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    return {"grad_norm": float(step.double().norm()) / LR}


def table(results: dict[str, dict[str, float]]) -> str:
    """Markdown: median peak RSS and range, the ratio to the batch-32 child, the gradient norm."""
    ref = results[REFERENCE]["peak_mib"]
    rows = [
        [
            name,
            f"{r['peak_mib']:.0f}",
            f"{r['min_mib']:.0f}-{r['max_mib']:.0f}",
            f"{r['peak_mib'] / ref:.2f}",
            f"{r['peak_mib'] - ref:+.0f}",
            f"{r['grad_norm']:.6f}" if "grad_norm" in r else "-",
        ]
        for name, r in results.items()
    ]
    header = [
        "configuration",
        "peak RSS MiB",
        "range",
        "ratio to batch 32",
        "MiB over batch 32",
        "grad norm",
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every configuration in fresh children, print the table, return the results."""
    configs = [c for c in CONFIGS if not c.startswith("mbp") or available("mbp")]
    config = {"effective": EFFECTIVE, "micro": MICRO}
    return _children.main(argv, __file__, configs, child, table, config)


if __name__ == "__main__":
    main()

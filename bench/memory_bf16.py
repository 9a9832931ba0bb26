"""Peak memory (process peak RSS, CPU) of one bf16 window: gradients and the float32 buffer.

A bf16 MLP of 16 x ``Linear(3072, 3072)`` (151 M parameters, 288 MiB; activations and data
are under 3 MiB) takes one plain SGD step (no optimizer state) on a window of 4 micro-batches
of 16 rows:

- **no accumulation**: one backward pass of the 64 rows; the gradient lives in ``.grad``;
- **bf16 .grad accumulation**: ``Accumulate(SGD, every=4, buffer=False)``; the micro-steps add
  up in the bf16 ``.grad`` (one bf16 rounding per addition: the precision issue the buffer
  solves);
- **accumopt default**: ``Accumulate(SGD, every=4)``; each bf16 gradient is folded into its
  float32 sum as autograd accumulates it, and released (issue 14);
- **accumopt buffer=True**: every micro-step stays in ``.grad`` until its backward pass ends,
  then is folded (what the default did before issue 14; rollback still does);

against the floor **model + data, no backward** (the same child, stopped before the first
forward pass). Each is reported as MiB over that floor and as a multiple of the bf16 parameter
bytes. That includes the backward pass's own workspace (on the CPU a bf16 matmul accumulates a
weight gradient in a float32 temporary: about 1/8x here), which every row pays; the last
column takes it out, with the no-accumulation row as the 1x reference: ``1 + (peak - peak of no
accumulation) / parameter bytes``, the peak of gradients and buffer together. Theory: 1x for
the first two; 2x plus one parameter's gradient (1/16x) for the default; 3x for
``buffer=True``.

Each configuration runs in fresh child processes (``python bench/memory_bf16.py --child
NAME``; three per configuration by default, round-robin; the table gives the median and the
range), whose peak RSS the parent reads with ``os.wait4`` on that child's pid. The parent
imports no torch (see ``memory.py`` on why). Run: ``python bench/memory_bf16.py [--children 3]
[--threads 1] [--json PATH]``.
"""

from __future__ import annotations

from typing import Any

import _children
from _children import BARE
from _common import markdown_table

LAYERS, WIDTH = 16, 3072
MICRO_STEPS, ROWS = 4, 16
PARAM_MIB = LAYERS * (WIDTH * WIDTH + WIDTH) * 2 / 2**20  # bf16: 2 bytes per element
FLOOR = "model + data, no backward"
CONFIGS = [
    BARE,
    FLOOR,
    "no accumulation (.grad only)",
    "bf16 .grad accumulation (buffer=False)",
    "accumopt default (float32 buffer)",
    "accumopt buffer=True (fold at micro-step end)",
]
_BUFFER = {CONFIGS[3]: False, CONFIGS[4]: None, CONFIGS[5]: True}


def child(config: str, threads: int) -> dict[str, float]:
    """Run ``config`` in this (fresh) process; return the norm of the last layer's bias
    gradient that the update applied (the same window gradient, up to bf16 rounding)."""
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):  # built in bf16: no float32 copy of the model ever exists
        layers += [nn.Linear(WIDTH, WIDTH, dtype=torch.bfloat16), nn.Tanh()]
    model = nn.Sequential(*layers)
    x = torch.randn(MICRO_STEPS * ROWS, WIDTH).bfloat16()
    y = torch.randn(MICRO_STEPS * ROWS, WIDTH).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last_bias = layers[-2].bias
    seen: list[float] = []  # the window gradient's last bias, as the inner step gets it
    opt.register_step_pre_hook(lambda *_: seen.append(float(last_bias.grad.double().norm())))

    def loss_of(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return (model(xb) - yb).float().pow(2).mean()

    if config == FLOOR:
        return {}
    if config == CONFIGS[2]:
        loss_of(x, y).backward()
        opt.step()
    elif config in _BUFFER:
        from accumopt import Accumulate

        acc = Accumulate(opt, every=MICRO_STEPS, buffer=_BUFFER[config])
        for xb, yb in zip(x.split(ROWS), y.split(ROWS)):
            loss_of(xb, yb).backward()
            acc.step()
            acc.zero_grad()
        assert acc.updates == 1
    else:
        raise ValueError(f"unknown configuration {config!r}; expected one of {CONFIGS}")
    return {"grad_norm": seen[0]}


def table(results: dict[str, dict[str, float]]) -> str:
    """Markdown: median peak RSS and range, MiB over the floor, that as a multiple of the
    bf16 parameter bytes, gradients and buffer alone (see the module docstring), and the
    applied gradient's last-bias norm (the same window)."""
    floor = results[FLOOR]["peak_mib"]
    plain = results[CONFIGS[2]]["peak_mib"]  # gradients 1x, plus the backward's workspace
    rows = []
    for name, r in results.items():
        over = r["peak_mib"] - floor
        measured = name not in (BARE, FLOOR)
        rows.append(
            [
                name,
                f"{r['peak_mib']:.0f}",
                f"{r['min_mib']:.0f}-{r['max_mib']:.0f}",
                f"{over:+.0f}" if measured else "-",
                f"{over / PARAM_MIB:.2f}x" if measured else "-",
                f"{1 + (r['peak_mib'] - plain) / PARAM_MIB:.2f}x" if measured else "-",
                f"{r['grad_norm']:.4f}" if "grad_norm" in r else "-",
            ]
        )
    header = [
        "configuration",
        "peak RSS MiB",
        "range",
        "MiB over floor",
        "x bf16 param bytes",
        "grads + buffer, x param bytes",
        "last-bias grad norm",
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every configuration in fresh children, print the table, return the results."""
    config = {
        "layers": LAYERS,
        "width": WIDTH,
        "micro_steps": MICRO_STEPS,
        "rows": ROWS,
        "param_mib": PARAM_MIB,
    }
    about = f"; bf16 parameters: {PARAM_MIB:.0f} MiB"
    return _children.main(argv, __file__, CONFIGS, child, table, config, about)


if __name__ == "__main__":
    main()

"""FSDP2 (fully_shard) + Accumulate on 2 CPU processes (gloo), spawned by the tests.

Same data layout and reference as test_ddp: both ranks' gathered parameters must equal
single-process full-batch training, with gradient sync only at the closing micro-step
(unsharded gradients inside the window) or reduce-scattered every micro-step.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

from accumopt.testing import run_ranks

sys.path.insert(0, os.path.dirname(__file__))
from test_ddp import EVERY, WINDOWS, WORLD, layout, make_opt, model_and_data, reference


def worker(rank: int, mode: str) -> list[list[float]]:
    """One rank: train the FSDP2-sharded model; the gathered full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accumopt import Accumulate

    base, x, y = model_and_data()
    model = copy.deepcopy(base)
    # an explicit CPU mesh: without it, FSDP2 on a machine with a GPU moves the shards there
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kwargs: dict[str, Any] = {"every": EVERY}
    if mode == "items":
        rows = sum(b - a for r in layout("uneven")[0] for a, b in r)
        kwargs = {"every_items": rows, "reduce_every_micro_step": True}
    elif mode == "reduce_every":
        kwargs["reduce_every_micro_step"] = True
    opt = Accumulate(make_opt(model.parameters()), model=model, **kwargs)
    for window in layout("uneven"):
        for a, b in window[rank]:
            opt.backward(((model(x[a:b]) - y[a:b]) ** 2).sum(), items=b - a)
            opt.step()
            opt.zero_grad()
    assert opt.updates == WINDOWS, opt.updates
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["window", "reduce_every", "items"])
def test_fsdp2_accumulate_equals_single_process_full_batch(mode: str) -> None:
    results = run_ranks(worker, mode, world_size=WORLD)
    expected = reference("uneven", weighted=True)
    for params in results:
        for p, q in zip(params, expected):
            torch.testing.assert_close(
                torch.tensor(p, dtype=torch.float64), q.flatten(), rtol=1e-10, atol=1e-12
            )

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


def shard(model: nn.Module) -> None:
    """``fully_shard`` every Linear layer and the root over the ranks, on an explicit CPU mesh
    (without it, FSDP2 on a machine with a GPU moves the shards there)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def worker(rank: int, mode: str) -> list[list[float]]:
    """One rank: train the FSDP2-sharded model; the gathered full parameters."""
    from accumopt import Accumulate

    base, x, y = model_and_data()
    model = copy.deepcopy(base)
    shard(model)
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


def drop_worker(rank: int, mode: str) -> list[list[float]]:
    """One rank: 2 micro-steps of junk, then flush() (refused: a partial FSDP2 window) or
    straight to discard(); then a full window. The gathered full parameters."""
    from accumopt import Accumulate

    base, x, y = model_and_data()
    model = copy.deepcopy(base)
    shard(model)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=EVERY, model=model)
    g = torch.Generator().manual_seed(rank)
    rows = [(torch.randn(3, x.shape[1], generator=g, dtype=x.dtype), rows) for rows in (3, 3)]
    if mode != "fresh":
        for junk, n in rows:
            opt.backward(((model(junk) - y[:n]) ** 2).sum(), items=n)
            opt.step()
    if mode == "flush":
        with pytest.raises(RuntimeError, match="FSDP2 without a gradient sync"):
            opt.flush()
        assert opt.micro_step == 2 and opt.updates == 0  # nothing changed
    if mode != "fresh":
        opt.discard()
    pieces = layout("uneven")[0][rank]
    for a, b in pieces:
        opt.backward(((model(x[a:b]) - y[a:b]) ** 2).sum(), items=b - a)
        opt.step()
        opt.zero_grad()
    assert opt.updates == 1, opt.updates
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


@pytest.mark.slow
def test_fsdp2_discard_drops_held_back_gradients_and_a_partial_flush_is_refused() -> None:
    """FSDP2 keeps a window's unsharded gradients itself until the synced pass: discard() left
    them to be reduced into the next window (max param diff 6e-3 against a fresh run, no
    error); a partial window's flush() failed inside torch ("Cannot flatten unevenly sharded
    tensor")."""
    fresh = run_ranks(drop_worker, "fresh", world_size=WORLD)
    for mode in ("discard", "flush"):
        for params, expected in zip(run_ranks(drop_worker, mode, world_size=WORLD), fresh):
            for p, q in zip(params, expected):  # the dropped micro-steps left nothing behind
                # (not bit for bit: after discard() FSDP2 syncs the first micro-step itself)
                torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-12, atol=1e-15)


def flush_worker(rank: int, _: Any) -> float:
    """One rank: 2 micro-steps reduce-scattered each (reduce_every_micro_step=True), then
    flush(): the largest parameter difference to one full-batch step on both ranks' rows."""
    from accumopt import Accumulate

    base, x, y = model_and_data()
    model, reference = copy.deepcopy(base), copy.deepcopy(base)
    shard(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = Accumulate(sgd, every=EVERY, model=model, reduce_every_micro_step=True)
    spans = [(0, 3), (3, 5), (5, 9), (9, 10)]  # rank r trains spans 2r and 2r + 1
    for a, b in spans[2 * rank : 2 * rank + 2]:
        opt.backward(((model(x[a:b]) - y[a:b]) ** 2).sum(), items=b - a)
        opt.step()
    assert opt.flush() and opt.updates == 1
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (((reference(x[:10]) - y[:10]) ** 2).sum() / 10).backward()
    ref_opt.step()
    pairs = zip(model.parameters(), reference.parameters())
    return max(float((p.full_tensor() - q).abs().max()) for p, q in pairs)


@pytest.mark.slow
def test_fsdp2_flush_of_a_partial_window_reduced_every_micro_step_is_exact() -> None:
    assert max(run_ranks(flush_worker, None, world_size=WORLD)) < 1e-12

"""Point 10 continued: foreach/fused inner optimizers, torch.compile, checkpointing, hooks, gc."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.utils.checkpoint
from helpers import assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from torch import nn

from accumopt import Accumulate


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_10_foreach_and_fused_inner_optimizers(impl: str, name: str) -> None:
    ref, model = twins(mlp(40))
    cls = getattr(torch.optim, name)
    kwargs = {"lr": 0.01, impl: True}
    ref_opt = cls(ref.parameters(), **kwargs)
    acc = Accumulate(cls(model.parameters(), **kwargs), every=3)
    for w in range(2):
        x, y = data(400 + w, 9)
        full_batch_step(ref, ref_opt, x, y)
        for xb, yb in zip(x.split([2, 3, 4]), y.split([2, 3, 4])):
            acc.backward(mse_sum(model, xb, yb), items=len(xb))
            acc.step()
            acc.zero_grad()
    assert_same_params(model, ref)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_10_compiled_model_with_eager_wrapper_equals_eager(backend: str) -> None:
    ref, model = twins(mlp(41))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    acc = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.01), every=2)
    for w in range(3):
        x, y = data(410 + w, 6)
        full_batch_step(ref, ref_opt, x, y)
        for xb, yb in zip(x.split([4, 2]), y.split([4, 2])):
            acc.backward(mse_sum(compiled, xb, yb), items=len(xb))
            acc.step()
            acc.zero_grad()
    assert acc.updates == 3
    assert_same_params(model, ref)


def test_10_non_reentrant_activation_checkpointing_counts_one_backward() -> None:
    ref, model = twins(mlp(42))
    x, y = data(42, 4)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    for xb, yb in zip(x.split(2), y.split(2)):
        out = torch.utils.checkpoint.checkpoint(model, xb, use_reentrant=False)
        acc.backward(((out - yb) ** 2).sum(), items=2)
        acc.step()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_10_hooks_on_wrapper_run_per_micro_step_and_on_inner_per_update() -> None:
    model = mlp(43)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    calls = {"wrapper": 0, "inner": 0}
    acc.register_step_post_hook(lambda *_: calls.__setitem__("wrapper", calls["wrapper"] + 1))
    acc.optimizer.register_step_post_hook(lambda *_: calls.__setitem__("inner", calls["inner"] + 1))
    x, y = data(43, 6)
    for xb, yb in zip(x.split(1), y.split(1)):
        mse_sum(model, xb, yb).backward()
        acc.step()
        acc.zero_grad()
    assert calls == {"wrapper": 6, "inner": 2}


def test_10_dropped_wrapper_stops_counting() -> None:
    model = mlp(44)
    old = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=1)
    ref = weakref.ref(old)
    del old  # freed by reference counting alone: no cycle keeps it counting
    assert ref() is None
    assert not model[0].weight._post_accumulate_grad_hooks  # and its hooks are gone
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    x, y = data(44, 2)
    for _ in range(2):  # the dropped wrapper's hooks must neither count nor raise
        mse_sum(model, x, y).backward()
        acc.step()
    assert acc.updates == 1


def test_10_shares_containers_with_inner_optimizer() -> None:
    inner = torch.optim.AdamW(mlp(45).parameters(), lr=0.01)
    acc = Accumulate(inner, every=2)
    assert acc.param_groups is inner.param_groups
    assert acc.state is inner.state
    assert acc.defaults is inner.defaults
    assert isinstance(acc, torch.optim.Optimizer)
    assert "every=2" in repr(acc) and "AdamW" in repr(acc)


def test_10_backward_that_fails_midway_pauses_counting_until_dealt_with() -> None:
    """A backward pass that dies (e.g. out of memory) leaves a partial gradient in .grad: the
    passes after it are not counted (step() then says why) until discard() drops it."""

    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 1)
            self.fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if self.fail:
                h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
            return self.b(h)

    model = Boom()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    x = torch.randn(2, 3)
    model.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(x).sum().backward()  # b's gradient was accumulated, then the pass died
    assert acc.micro_step == 0 and model.b.weight.grad is not None
    model.fail = False
    model(x).sum().backward()
    assert acc.micro_step == 0
    with pytest.raises(RuntimeError, match="failed part-way"):
        acc.step()
    acc.discard()
    assert model.b.weight.grad is None
    for _ in range(2):
        model(x).sum().backward()
        acc.step()
    assert acc.updates == 1

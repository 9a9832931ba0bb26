"""Faults from the field (issue "Faults from the field"): each test is named after the item it
covers and fails on accumopt before the fix."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from accumopt import Accumulate


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _die_part_way(model: nn.Sequential, x: torch.Tensor) -> None:
    """A backward pass that dies after the last layer's gradient was written."""

    def boom(_: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("simulated")

    h = model[0](x)
    h.register_hook(boom)
    with pytest.raises(torch.OutOfMemoryError):
        model[2](model[1](h)).sum().backward()


def test_a_second_wrapper_over_an_inner_optimizer_a_live_wrapper_wraps_is_refused() -> None:
    model = _mlp(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    first = Accumulate(inner, every=2)
    with pytest.raises(TypeError, match="already wrapped by a live Accumulate"):
        Accumulate(inner, every=4)
    assert first.every == 2
    del first
    gc.collect()
    again = Accumulate(inner, every=4)  # the first one is gone: wrapping again is fine
    assert again.every == 4


def test_enable_rollback_while_counting_is_paused_is_refused() -> None:
    model = _mlp(1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    _die_part_way(model, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="failed part-way"):
        acc.enable_rollback()
    assert not acc._buffer.buffer_all  # nothing changed
    acc.discard()
    acc.enable_rollback()
    assert acc._buffer.buffer_all


def test_state_dict_while_counting_is_paused_is_refused() -> None:
    model = _mlp(2)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()  # one counted micro-step
    acc.step()
    _die_part_way(model, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="failed part-way"):
        acc.state_dict()
    acc.discard()
    assert acc.state_dict()["accumopt"]["window"] is None


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo: it cannot trace the callback
def test_compiled_autograd_refusal_names_compiled_autograd_not_out_of_memory() -> None:
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    model = nn.Linear(3, 1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="compiled autograd") as refused:
        acc.step()
    assert "out of memory" not in str(refused.value)

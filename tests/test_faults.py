"""Faults from the field (issue "Faults from the field"): each test is named after the item it
covers and fails on accumopt before the fix."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from helpers import entry_of
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
    assert entry_of(acc.state_dict())["state"]["micro_step"] == 0


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


class _FailsOnce(torch.optim.SGD):
    """SGD whose first step() raises, as an OOM while Adam allocates its state would."""

    failures = 1

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("simulated: out of memory in the optimizer's step")
        return super().step(closure)


@pytest.mark.parametrize("amp", [False, True])
def test_an_exception_in_the_inner_step_leaves_the_wrapper_broken_until_discard(amp: bool) -> None:
    """The inner step raises before its update (an OOM while Adam allocates its state): the
    wrapper refuses everything until discard(), which drops the window; the next window is
    exact, under AMP too (a plain opt.step() after a raising scaler.step kept the grad_scale and
    found_inf that scaler.step had set, and unscaled the next window twice: rel 0.38)."""
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 1, dtype=torch.float64)
    ref = _mlp(3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    ((ref(x[6:]) - y[6:]) ** 2).mean().backward()  # the first window was dropped
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()

    model = _mlp(3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1) if amp else None
    acc = Accumulate(
        _FailsOnce(model.parameters(), lr=0.1), every=2, max_grad_norm=0.5, scaler=scaler
    )
    failed = 0
    for xb, yb in zip(x.split(3), y.split(3)):
        loss = ((model(xb) - yb) ** 2).sum()
        acc.backward(loss if scaler is None else scaler.scale(loss), items=3)
        try:
            acc.step() if scaler is None else scaler.step(acc)
        except torch.OutOfMemoryError:
            failed += 1
            with pytest.raises(RuntimeError, match="failed part-way"):
                acc.step()
            acc.discard()
            assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
        if scaler is not None:
            scaler.update()
        acc.zero_grad()
    assert failed == 1 and acc.updates == 1 and acc.did_update
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_a_checkpoint_loaded_right_after_step_does_not_keep_the_last_window_s_gradient() -> None:
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)

    def loss(m: nn.Module, a: int, b: int) -> torch.Tensor:
        return ((m(x[a:b]) - y[a:b]) ** 2).sum()

    model = _mlp(4)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2, buffer=True)
    opt.backward(loss(model, 0, 3), items=3)
    opt.step()
    opt.zero_grad()
    saved = copy.deepcopy({"m": model.state_dict(), "o": opt.state_dict()})
    opt.backward(loss(model, 3, 8), items=5)
    opt.step()
    expected = [p.detach().clone() for p in model.parameters()]

    other = _mlp(4)
    live = Accumulate(torch.optim.SGD(other.parameters(), lr=0.1), every=2, buffer=True)
    for a, b in ((0, 4), (4, 8)):  # a whole window; step() done, zero_grad() not yet
        live.backward(loss(other, a, b), items=b - a)
        live.step()
    other.load_state_dict(saved["m"])
    live.load_state_dict(copy.deepcopy(saved["o"]))
    live.zero_grad()  # a no-op: the restored window is open
    live.backward(loss(other, 3, 8), items=5)
    live.step()
    for p, q in zip(other.parameters(), expected):
        assert torch.equal(p, q)


@pytest.mark.parametrize("error", [RuntimeError("a user's hook failed"), KeyboardInterrupt()])
def test_a_pass_killed_by_a_user_hook_or_ctrl_c_after_a_gradient_landed_pauses_counting(
    error: BaseException,
) -> None:
    """The user's post-accumulate-grad hook (registered before the wrapper, so it runs first)
    raises right after the last layer's weight got its gradient: that partial gradient must
    not slip into the window as if the retried micro-step were clean."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Tanh(), nn.Linear(3, 1, bias=False)).double()  # one parameter
    x = torch.randn(4, 3, dtype=torch.float64)
    armed = [True]

    def explode(_: torch.Tensor) -> None:
        if armed[0]:
            armed[0] = False
            raise error

    model[1].weight.register_post_accumulate_grad_hook(explode)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    with pytest.raises(type(error)):
        model(x).sum().backward()
    assert model[1].weight.grad is not None  # the partial gradient is there
    with pytest.raises(RuntimeError, match="failed part-way"):
        acc.backward(model(x).sum())
    acc.discard()
    model(x).sum().backward()  # counted again once the partial gradient is dropped
    acc.step()
    assert acc.micro_step == 1


def test_max_grad_norm_over_a_sparse_embedding_clips_like_the_dense_reference() -> None:
    idx = torch.tensor([[1, 2, 2], [3, 1, 9]])

    def embedding(sparse: bool) -> nn.Embedding:
        torch.manual_seed(0)
        return nn.Embedding(10, 4, sparse=sparse).double()

    dense = embedding(False)
    ref = torch.optim.SGD(dense.parameters(), lr=0.5)
    (dense(idx).pow(2).sum() / 2).backward()
    torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.3)
    ref.step()

    sparse = embedding(True)
    acc = Accumulate(torch.optim.SGD(sparse.parameters(), lr=0.5), every=2, max_grad_norm=0.3)
    for row in idx:  # two micro-steps; index 1 and 2 repeat: uncoalesced sparse gradients
        sparse(row).pow(2).sum().backward()
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    torch.testing.assert_close(sparse.weight, dense.weight, rtol=1e-12, atol=1e-14)


def test_with_amp_a_micro_step_that_reaches_no_wrapped_parameter_counts_with_zero_gradient() -> (
    None
):
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    other = nn.Linear(3, 1).double()  # not wrapped
    results = []
    for amp in (False, True):
        model = _mlp(8)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if amp else None
        acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2, scaler=scaler)
        for loss in (other(x).sum(), ((model(x) - y) ** 2).sum()):
            acc.backward(loss if scaler is None else scaler.scale(loss), items=4)
            if scaler is None:
                acc.step()
            else:
                scaler.step(acc)
                scaler.update()
            acc.zero_grad()
        assert acc.updates == 1
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_a_count_left_by_a_pass_that_failed_part_way_is_named_as_that_failure() -> None:
    """next_items(n), then a pass that dies part-way: the next call says the pass failed (the
    count it left waiting is a consequence), and discard() drops both."""
    model = _mlp(3)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    acc.next_items(3)
    _die_part_way(model, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="an earlier backward pass failed part-way"):
        acc.next_items(2)
    acc.discard()
    acc.next_items(2)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    assert acc.micro_step == 1 and acc.items == 2.0

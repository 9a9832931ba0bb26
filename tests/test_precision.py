"""The window buffer (float32 sums for low-precision parameters) and non-finite micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import OPTIMIZERS, assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accumopt import Accumulate


def run(
    acc: Accumulate,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    sizes: list[int],
    poison: int | None = None,
) -> None:
    for i, (xb, yb) in enumerate(zip(x.split(sizes), y.split(sizes))):
        loss = mse_sum(model, xb, yb)
        if i == poison:
            loss = loss * float("nan")
        acc.backward(loss, items=len(xb))
        acc.step()
        acc.zero_grad()


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5),
)
def test_buffer_true_changes_nothing_for_float64_parameters(
    seed: int, opt_name: str, sizes: list[int]
) -> None:
    ref, model = twins(mlp(seed))
    acc = Accumulate(OPTIMIZERS[opt_name](list(model.parameters())), every=len(sizes), buffer=True)
    ref_opt = OPTIMIZERS[opt_name](list(ref.parameters()))
    for w in range(2):
        x, y = data(seed + w, sum(sizes))
        full_batch_step(ref, ref_opt, x, y)
        run(acc, model, x, y, sizes)
    assert_same_params(model, ref)


def test_default_buffers_only_low_precision_parameters() -> None:
    model = mlp(60)
    model[2].to(torch.bfloat16)  # a mixed-precision model: last layer in bf16

    class Cast(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.to(torch.bfloat16)

    net = nn.Sequential(model[0], model[1], Cast(), model[2])
    acc = Accumulate(torch.optim.SGD(net.parameters(), lr=0.1), every=3)
    x, y = data(60, 4)
    net(x).float().sub(y).pow(2).sum().backward()
    acc.step()
    assert set(acc._buffer.sums) == set(model[2].parameters())
    assert all(acc._buffer.sums[p].dtype == torch.float32 for p in model[2].parameters())
    assert model[2].weight.grad is None and model[0].weight.grad is not None


def bf16_gradient_errors(k: int, buffer: bool | None) -> tuple[float, float]:
    """(error of the window gradient, median error of one micro-batch gradient), each relative
    to its own float64 value, for a bf16 MLP accumulating k micro-batches of 8 samples."""
    torch.manual_seed(0)
    model16 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(torch.bfloat16)
    model64 = copy.deepcopy(model16).double()  # the same (bf16-representable) weights
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(k, 8, 16, generator=g).bfloat16().double()
    ys = torch.randn(k, 8, 1, generator=g).bfloat16().double()

    def flat_grad(m: nn.Module) -> torch.Tensor:
        return torch.cat([p.grad.double().flatten() for p in m.parameters()])

    (sum(mse_sum(model64, x, y) for x, y in zip(xs, ys)) / (8 * k)).backward()
    ref = flat_grad(model64)
    acc = Accumulate(torch.optim.SGD(model16.parameters(), lr=0.0), every=k, buffer=buffer)
    for x, y in zip(xs, ys):
        (mse_sum(model16, x.bfloat16(), y.bfloat16()) / 8).backward()
        if acc.will_update:
            window = flat_grad(model16)
        acc.step()
    window_err = ((window - ref).norm() / ref.norm()).item()
    del acc  # stop counting: the single micro-batches below are plain autograd
    singles = []
    for x, y in list(zip(xs, ys))[:16]:  # the floor: one micro-batch's own bf16 error
        model64.zero_grad()
        model16.zero_grad()
        (mse_sum(model64, x, y) / 8).backward()
        (mse_sum(model16, x.bfloat16(), y.bfloat16()) / 8).backward()
        one = flat_grad(model64)
        singles.append(((flat_grad(model16) - one).norm() / one.norm()).item())
    single_err = sorted(singles)[len(singles) // 2]
    return window_err, single_err


def test_float32_buffer_keeps_bf16_accumulation_error_flat_in_k() -> None:
    """Ordering, not timing: with the buffer the window gradient is about as accurate as one
    bf16 micro-batch gradient at every k; plain bf16 .grad sums drift as k grows."""
    for k in (16, 256):
        buffered, floor = bf16_gradient_errors(k, buffer=None)
        plain, _ = bf16_gradient_errors(k, buffer=False)
        assert buffered <= 1.5 * floor, (k, buffered, floor)
        assert plain > buffered, (k, plain, buffered)
    plain_256, floor = bf16_gradient_errors(256, buffer=False)
    assert plain_256 > 2 * floor


@pytest.mark.parametrize("poison", [0, 2, 3])  # first, middle, last micro-step
def test_nonfinite_skip_window(poison: int) -> None:
    model = mlp(61)
    before = copy.deepcopy(model)
    acc = Accumulate(
        torch.optim.AdamW(model.parameters(), lr=0.01), every=4, nonfinite="skip_window"
    )
    x, y = data(61, 8)
    run(acc, model, x, y, [2, 2, 2, 2], poison=poison)
    assert not acc.did_update and acc.updates == 0 and acc.micro_step == 0
    assert_same_params(model, before, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("policy", ["raise", "skip_micro_batch", "skip", True])
def test_policies_removed_in_0_2_are_refused_with_the_migration(policy: object) -> None:
    with pytest.raises(ValueError, match=r"not a policy.*'skip_window'.*CHANGELOG"):
        Accumulate(torch.optim.SGD(mlp(62).parameters(), lr=0.1), every=2, nonfinite=policy)


def test_buffer_round_trips_through_state_dict_mid_window() -> None:
    torch.manual_seed(64)
    base = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(torch.bfloat16)
    x, y = data(64, 8)
    x, y = x.bfloat16(), y.bfloat16()

    def fresh() -> tuple[nn.Module, Accumulate]:
        m = copy.deepcopy(base)
        return m, Accumulate(torch.optim.Adam(m.parameters(), lr=0.01), every=4)

    whole, acc = fresh()
    run(acc, whole, x, y, [2, 2, 2, 2])
    part, acc2 = fresh()
    run(acc2, part, x[:4], y[:4], [2, 2])
    assert acc2._buffer  # the float32 sums live in the buffer, not in .grad
    saved = copy.deepcopy({"m": part.state_dict(), "o": acc2.state_dict()})
    resumed, acc3 = fresh()
    resumed.load_state_dict(saved["m"])
    acc3.load_state_dict(saved["o"])
    run(acc3, resumed, x[4:], y[4:], [2, 2])
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_drop_micro_step_needs_the_buffer_and_enable_rollback_provides_it() -> None:
    ref, model = twins(mlp(65))
    x, y = data(65, 6)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x[:4], y[:4])
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    acc.backward(mse_sum(model, x[:2], y[:2]), items=2)
    acc.step()
    with pytest.raises(RuntimeError, match="cannot be dropped alone"):
        acc.drop_micro_step()
    acc.enable_rollback()  # mid-window: folds what .grad holds into the buffer
    hidden = model[1](model[0](x[4:]))
    hidden.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("out of memory (fake)")))
    with pytest.raises(RuntimeError, match="fake"):  # dies after the last layer's gradients
        acc.backward(((model[2](hidden) - y[4:]) ** 2).sum(), items=2)
    assert model[2].weight.grad is not None and acc.micro_step == 1
    acc.drop_micro_step()
    acc.backward(mse_sum(model, x[2:4], y[2:4]), items=2)
    acc.step()
    assert acc.did_update
    assert_same_params(model, ref)

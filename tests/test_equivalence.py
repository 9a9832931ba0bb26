"""Property tests: accumulated windows equal full-batch training, in float64.

Hypothesis draws the model, the data, an uneven partition of every window into micro-batches,
the optimizer and the number of consecutive windows; the parameters after each window must equal
those of plain full-batch training on the concatenated window.
"""

from __future__ import annotations

import itertools

import torch
from helpers import OPTIMIZERS, assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accumopt import Accumulate


@st.composite
def partitions(draw: st.DrawFn, min_parts: int = 1, max_parts: int = 6) -> list[int]:
    """Sizes (each >= 1) of the micro-batches of one window."""
    return draw(st.lists(st.integers(1, 7), min_size=min_parts, max_size=max_parts))


@st.composite
def windows_of(draw: st.DrawFn, n: int, count: int) -> list[list[int]]:
    """``count`` windows of ``n`` items each, each cut into random uneven micro-batches."""
    out = []
    for _ in range(count):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, 5)))) if n > 1 else []
        bounds = [0, *cuts, n]
        out.append([b - a for a, b in itertools.pairwise(bounds)])
    return out


def hidden_model(seed: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(4, width)]
    for _ in range(depth - 1):
        layers += [nn.Tanh(), nn.Linear(width, width)]
    layers += [nn.Tanh(), nn.Linear(width, 3)]
    return nn.Sequential(*layers)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    width=st.integers(1, 8),
    depth=st.integers(1, 3),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    by_items=st.booleans(),
    n=st.integers(1, 20),
    given_model=st.booleans(),
    data_=st.data(),
)
def test_item_weighted_windows_equal_full_batch(
    seed: int,
    width: int,
    depth: int,
    opt_name: str,
    by_items: bool,
    n: int,
    given_model: bool,
    data_: st.DataObject,
) -> None:
    """Ragged micro-batches through opt.backward(loss_sum, items=n) equal the full batch.

    The window is given in items (``every_items=n``: each window has its own number of
    micro-batches) or, when every window happens to have the same count, in micro-steps.
    Backward passes are counted at the parameters or (``given_model``) at the model's outputs.
    """
    windows = data_.draw(windows_of(n, data_.draw(st.integers(1, 3))))
    ref, acc_model = twins(hidden_model(seed, width, depth))
    ref_opt = OPTIMIZERS[opt_name](list(ref.parameters()))
    inner = OPTIMIZERS[opt_name](list(acc_model.parameters()))
    counts = {len(sizes) for sizes in windows}
    model = acc_model if given_model else None
    if by_items or len(counts) > 1:
        acc = Accumulate(inner, every_items=n, model=model)
    else:
        acc = Accumulate(inner, every=counts.pop(), model=model)
    for w, sizes in enumerate(windows):
        x, y = data(seed + w, n)
        full_batch_step(ref, ref_opt, x, y)
        for xb, yb in zip(x.split(sizes), y.split(sizes)):
            acc.backward(mse_sum(acc_model, xb, yb), items=len(xb))
            acc.step()
            acc.zero_grad()
        assert acc.micro_step == 0
        assert_same_params(acc_model, ref)
    assert acc.updates == len(windows)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    every=st.integers(1, 6),
    micro=st.integers(1, 5),
    n_windows=st.integers(1, 3),
    given_model=st.booleans(),
)
def test_plain_backward_of_equal_micro_batches_equals_full_batch(
    seed: int, opt_name: str, every: int, micro: int, n_windows: int, given_model: bool
) -> None:
    """The README loop: mean loss per micro-batch, loss.backward(), every=k (counted at the
    parameters, or at the model's outputs with ``model=``)."""
    ref, acc_model = twins(mlp(seed))
    ref_opt = OPTIMIZERS[opt_name](list(ref.parameters()))
    acc = Accumulate(
        OPTIMIZERS[opt_name](list(acc_model.parameters())),
        every=every,
        model=acc_model if given_model else None,
    )
    for w in range(n_windows):
        x, y = data(seed + w, every * micro)
        full_batch_step(ref, ref_opt, x, y)
        for xb, yb in zip(x.split(micro), y.split(micro)):
            (mse_sum(acc_model, xb, yb) / len(xb)).backward()
            acc.step()
            acc.zero_grad()
        assert_same_params(acc_model, ref)
    assert acc.updates == n_windows


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), sizes=partitions(min_parts=2))
def test_uneven_plain_backward_is_mean_over_micro_batches(seed: int, sizes: list[int]) -> None:
    """Unweighted windows are the mean of the micro-batch losses (documented semantics)."""
    ref, acc_model = twins(mlp(seed))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = Accumulate(torch.optim.SGD(acc_model.parameters(), lr=0.1), every=len(sizes))
    x, y = data(seed, sum(sizes))
    loss = sum(mse_sum(ref, xb, yb) / len(xb) for xb, yb in zip(x.split(sizes), y.split(sizes)))
    (loss / len(sizes)).backward()
    ref_opt.step()
    for xb, yb in zip(x.split(sizes), y.split(sizes)):
        (mse_sum(acc_model, xb, yb) / len(xb)).backward()
        acc.step()
    assert_same_params(acc_model, ref)

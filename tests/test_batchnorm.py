"""BatchNorm under micro-batching: the one-time warning and the momentum remedy."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from accumopt import Accumulate, MicroBatchRunner
from accumopt.batchnorm import scale_batchnorm_momentum, warn_small_batchnorm


def bn_model() -> nn.Module:
    torch.manual_seed(90)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))


def test_small_micro_batches_warn_once_per_model() -> None:
    model = bn_model()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=32)
    runner = MicroBatchRunner(
        acc, lambda b: model(b).sum(), micro_batch_size=4, model=model, loss_reduction="sum"
    )
    with pytest.warns(UserWarning, match=r"micro-batches of 4 rows pass through 1 BatchNorm"):
        runner(torch.randn(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner(torch.randn(16, 4))  # once is enough
        warn_small_batchnorm(bn_model().eval(), 4)  # eval mode: statistics are fixed
        warn_small_batchnorm(bn_model(), 64)  # large micro-batches


def test_scaled_momentum_decays_per_window_like_one_batch_update() -> None:
    """k micro-batch updates with the scaled momentum forget the old running mean exactly as
    one update with the original momentum does."""
    k = 4
    model = bn_model()
    bn = model[1]
    bn.running_mean.fill_(10.0)
    scale_batchnorm_momentum(model, k)
    x = torch.zeros(8, 6)
    for _ in range(k):
        bn(x)  # batch mean 0: the running mean decays towards 0
    torch.testing.assert_close(bn.running_mean, torch.full((6,), 10.0 * (1 - 0.1)))


def test_scale_batchnorm_momentum_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="micro_steps=0"):
        scale_batchnorm_momentum(bn_model(), 0)

"""Point 11: bad input gets a clear ValueError/TypeError, and loses nothing already accumulated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import data, mlp, mse_sum
from torch import nn

from accumopt import Accumulate


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(mlp(0).parameters(), lr=0.1)


CONSTRUCTION_ERRORS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    ("every zero", lambda: Accumulate(sgd(), every=0), ValueError, r"every=0 is not a positive"),
    ("every negative", lambda: Accumulate(sgd(), every=-3), ValueError, r"every=-3"),
    ("every float", lambda: Accumulate(sgd(), every=2.0), ValueError, r"every=2\.0"),
    ("every bool", lambda: Accumulate(sgd(), every=True), ValueError, r"every=True"),
    ("neither window", lambda: Accumulate(sgd()), ValueError, r"expected exactly one"),
    (
        "both windows",
        lambda: Accumulate(sgd(), every=2, every_items=64),
        ValueError,
        r"expected exactly one",
    ),
    (
        "every_items zero",
        lambda: Accumulate(sgd(), every_items=0),
        ValueError,
        r"every_items=0 is not a positive finite",
    ),
    (
        "every_items nan",
        lambda: Accumulate(sgd(), every_items=float("nan")),
        ValueError,
        r"every_items=nan",
    ),
    (
        "not an optimizer",
        lambda: Accumulate(mlp(0), every=2),
        TypeError,
        r"got Sequential; expected e\.g\.",
    ),
    (
        "parameter list",
        lambda: Accumulate(list(mlp(0).parameters()), every=2),
        TypeError,
        r"got list",
    ),
    (
        "already wrapped",
        lambda: Accumulate(Accumulate(sgd(), every=2), every=2),
        TypeError,
        r"already an Accumulate",
    ),
    (
        "lbfgs",
        lambda: Accumulate(torch.optim.LBFGS(mlp(0).parameters()), every=2),
        TypeError,
        r"LBFGS re-evaluates the loss",
    ),
    (
        "reduction",
        lambda: Accumulate(sgd(), every=2, reduction="avg"),
        ValueError,
        r"reduction='avg' is not supported",
    ),
    (
        "max_grad_norm",
        lambda: Accumulate(sgd(), every=2, max_grad_norm=-1.0),
        ValueError,
        r"max_grad_norm=-1\.0",
    ),
    (
        "scaler",
        lambda: Accumulate(sgd(), every=2, scaler=object()),
        TypeError,
        r"scaler must be a torch\.amp\.GradScaler",
    ),
]


@pytest.mark.parametrize(
    ("build", "exc", "pattern"),
    [case[1:] for case in CONSTRUCTION_ERRORS],
    ids=[case[0] for case in CONSTRUCTION_ERRORS],
)
def test_11_bad_construction(build: Callable[[], Any], exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        build()


@pytest.fixture
def half_window() -> tuple[nn.Module, Any, list[torch.Tensor]]:
    """A wrapper with one weighted micro-step accumulated, and a copy of its gradients."""
    model = mlp(1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    x, y = data(1, 4)
    acc.backward(mse_sum(model, x, y), items=4)
    acc.step()
    return model, acc, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("items", "pattern"),
    [
        (-1, r"items=-1\.?0? is not a finite number >= 0"),
        (float("inf"), r"items=inf"),
        (float("nan"), r"items=nan"),
        (True, r"items=True"),
        ("4", r"items='4'"),
        (torch.tensor([1.0, 2.0]), r"shape \(2,\)"),
    ],
)
def test_11_bad_item_counts_lose_nothing(half_window: Any, items: Any, pattern: str) -> None:
    model, acc, grads = half_window
    x, y = data(2, 2)
    with pytest.raises(ValueError, match=pattern):
        acc.backward(mse_sum(model, x, y), items=items)
    assert acc.micro_step == 1 and acc.items == 4
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_11_mixing_weighted_and_unweighted_in_one_window(half_window: Any) -> None:
    model, acc, grads = half_window
    x, y = data(2, 2)
    with pytest.raises(ValueError, match=r"expected one kind per window.*Nothing was accumulated"):
        acc.backward(mse_sum(model, x, y))  # opt.backward without items
    assert acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    # a plain loss.backward() cannot be refused before autograd runs: it is reported, and
    # discard() drops the window
    with pytest.raises(ValueError, match=r"call opt\.discard\(\)"):
        mse_sum(model, x, y).backward()
    assert acc.micro_step == 1
    acc.discard()
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())


def test_11_every_items_window_needs_item_counts() -> None:
    model = mlp(3)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    x, y = data(3, 2)
    with pytest.raises(ValueError, match=r"closes its window every 8 items"):
        acc.backward(mse_sum(model, x, y))
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())


def test_11_backward_after_the_boundary_needs_a_step_first() -> None:
    model = mlp(4)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=1)
    x, y = data(4, 2)
    acc.backward(mse_sum(model, x, y), items=2)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"call opt\.step\(\) before the next backward"):
        acc.backward(mse_sum(model, x, y), items=2)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    acc.step()
    assert acc.did_update


def test_11_load_state_dict_with_other_window_settings_changes_nothing() -> None:
    model = mlp(6)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    x, y = data(6, 2)
    acc.backward(mse_sum(model, x, y), items=2)
    acc.step()
    saved = acc.state_dict()
    other = Accumulate(torch.optim.SGD(mlp(6).parameters(), lr=0.1), every=4)
    with pytest.raises(ValueError, match=r"saved with \(every, every_items, reduction\)=\(3,"):
        other.load_state_dict(saved)
    assert other.micro_step == 0

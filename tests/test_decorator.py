"""accumopt.apply: the mbp-pytorch drop-in, with mbp-pytorch 0.2.6's defects fixed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_params, data, mlp, twins
from torch import nn

import accumopt


def full_batch_grad_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    F.mse_loss(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize(("n", "ub"), [(40, 16), (7, 3), (5, 5), (3, 8)])
def test_short_last_micro_batch_is_weighted_by_its_rows(n: int, ub: int) -> None:
    """mbp weights 16, 16, 8 rows as 1/3 each (18 % gradient error); we weight by rows."""
    ref, model = twins(mlp(80))
    x, y = data(80, n)
    with torch.no_grad():
        expected_loss = F.mse_loss(ref(x), y)
    full_batch_grad_step(ref, x, y)

    @accumopt.apply(["x", "label"], ub)
    def train_fn(model: nn.Module, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), label)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = train_fn(model, x=x, label=y)
    opt.step()
    torch.testing.assert_close(loss, expected_loss)  # the batch's mean loss
    assert not loss.requires_grad
    assert_same_params(model, ref)


def test_other_outputs_are_gathered_like_mbp() -> None:
    model = mlp(81)
    x, y = data(81, 10)

    @accumopt.apply(["x", "label"], 4)
    def train_fn(model: nn.Module, x: torch.Tensor, label: torch.Tensor) -> tuple:
        out = model(x)
        return F.mse_loss(out, label), out.detach(), "tag"

    loss, outputs, tags = train_fn(model, x=x, label=y)
    assert outputs.shape == (10, 3) and tags == ["tag", "tag", "tag"]
    with torch.no_grad():
        torch.testing.assert_close(loss, F.mse_loss(model(x), y))


def test_grad_scaler_is_usable() -> None:
    ref, model = twins(mlp(82))
    x, y = data(82, 9)
    full_batch_grad_step(ref, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    @accumopt.apply(["x", "label"], 4, scaler=scaler)
    def train_fn(model: nn.Module, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), label)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_fn(model, x=x, label=y)
    scaler.step(opt)
    scaler.update()
    assert_same_params(model, ref)


def test_bad_calls_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"device_ids=\[0, 1\]; expected None"):
        accumopt.apply(["x"], 16, device_ids=[0, 1])
    with pytest.raises(ValueError, match=r"ub_size=0"):
        accumopt.apply(["x"], 0)
    with pytest.raises(ValueError, match=r"apply: device='foo' is not a device"):
        accumopt.apply(["x"], 16, device="foo")
    with pytest.raises(TypeError, match=r"apply: device=True is a bool"):
        accumopt.apply(["x"], 16, device=True)

    @accumopt.apply(["x", "label"], 4)
    def train_fn(model: nn.Module, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), label)

    x, y = data(83, 4)
    with pytest.raises(TypeError, match=r"not passed by keyword"):
        train_fn(mlp(83), x, label=y)
    with pytest.raises(
        ValueError, match=r"batch\['label'\] has 3 rows along dim 0 .* but batch\['x'\] has 4"
    ):
        train_fn(mlp(83), x=x, label=y[:3])


def test_a_nested_leaf_with_a_short_last_micro_batch_is_cut_at_the_batch_end() -> None:
    """A jagged nested tensor in the batch: the last, shorter micro-batch gets the rows that are
    left (6 rows at 4 per micro-batch), and the gradient equals the whole batch's."""
    ref, model = twins(mlp(81))
    x, y = data(81, 6)
    rows = torch.nested.nested_tensor(
        [torch.ones(k % 3 + 1) for k in range(6)], layout=torch.jagged
    )
    full_batch_grad_step(ref, x, y)
    seen: list[int] = []

    @accumopt.apply(["x", "label", "rows"], 4)
    def train_fn(
        model: nn.Module, x: torch.Tensor, label: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        seen.append(rows.size(0))
        return F.mse_loss(model(x), label)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_fn(model, x=x, label=y, rows=rows)
    opt.step()
    assert seen == [4, 2]
    assert_same_params(model, ref)

"""parallel_backward: one backward over several devices equals the full-batch update (float64)."""

from __future__ import annotations

import copy
import doctest
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import OPTIMIZERS, assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import accumopt.parallel
from accumopt import Accumulate
from accumopt.parallel import parallel_backward

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The piece's mean loss per sample (pieces are weighted by their sizes)."""
    return mse_sum(model, batch["x"], batch["y"]) / len(batch["x"])


def sum_and_count(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The piece's summed loss and its sample count, as a Python int."""
    return mse_sum(model, batch["x"], batch["y"]), len(batch["x"])


def masked(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-like weighting: only rows with mask 1 carry a loss; the count is a tensor."""
    per_row = F.mse_loss(model(batch["x"]), batch["y"], reduction="none").sum(1)
    return (per_row * batch["mask"]).sum(), batch["mask"].sum()


def make_batch(seed: int, n: int) -> dict[str, Any]:
    x, y = data(seed, n)
    mask = (torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.6).to(x.dtype)
    mask[0] = 1.0  # at least one row that carries a loss
    return {"x": x, "y": y, "mask": mask, "note": "rows"}


def reference_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any], kind: str
) -> None:
    """Plain full-batch step on the union of the pieces."""
    if kind == "masked":
        opt.zero_grad()
        loss_sum, count = masked(model, batch)
        (loss_sum / count).backward()  # type: ignore[no-untyped-call]
        opt.step()
    else:
        full_batch_step(model, opt, batch["x"], batch["y"])


LOSS_FNS: dict[str, Callable[..., Any]] = {
    "mean": mean_loss,
    "sum_items": sum_and_count,
    "masked": masked,
}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(3, 17),
    n_devices=st.sampled_from([2, 3]),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    kind=st.sampled_from(sorted(LOSS_FNS)),
    weights=st.one_of(st.none(), st.lists(st.integers(1, 5), min_size=3, max_size=3)),
)
def test_one_call_equals_the_full_batch_step(
    seed: int, n: int, n_devices: int, opt_name: str, kind: str, weights: list[int] | None
) -> None:
    ref, par = twins(mlp(seed))
    ref_opt, par_opt = (
        OPTIMIZERS[opt_name](list(ref.parameters())),
        OPTIMIZERS[opt_name](list(par.parameters())),
    )
    batch = make_batch(seed, n)
    reference_step(ref, ref_opt, batch, kind)
    par_opt.zero_grad()
    mean = parallel_backward(
        par,
        LOSS_FNS[kind],
        batch,
        ["cpu"] * n_devices,
        weights=None if weights is None else weights[:n_devices],
    )
    par_opt.step()
    assert_same_params(par, ref)
    assert mean.shape == () and not mean.requires_grad


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", sorted(LOSS_FNS))
def test_calls_compose_with_an_accumulate_window(opt_name: str, kind: str) -> None:
    """Two windows of three calls (uneven batch lengths, 2 or 3 devices) equal two full steps."""
    ref, par = twins(mlp(7))
    ref_opt = OPTIMIZERS[opt_name](list(ref.parameters()))
    acc = Accumulate(OPTIMIZERS[opt_name](list(par.parameters())), every=3)
    lengths = [[5, 3, 9], [4, 11, 6]]
    for w, window in enumerate(lengths):
        batches = [make_batch(100 * w + i, m) for i, m in enumerate(window)]
        union = {k: torch.cat([b[k] for b in batches]) for k in ("x", "y", "mask")}
        reference_step(ref, ref_opt, union, kind)
        for i, batch in enumerate(batches):
            devices = ["cpu"] * (2 + i % 2)
            parallel_backward(par, LOSS_FNS[kind], batch, devices, opt=acc)
            assert acc.micro_step == i + 1  # one backward pass per call: one micro-step
            acc.step()
            acc.zero_grad()
        assert acc.updates == w + 1
    assert_same_params(par, ref)


def test_returned_mean_is_the_full_batch_mean_loss() -> None:
    model = mlp(3)
    batch = make_batch(3, 10)
    for kind, loss_fn in LOSS_FNS.items():
        with torch.no_grad():
            expected = (
                masked(model, batch)[0] / batch["mask"].sum()
                if kind == "masked"
                else mean_loss(model, batch)
            )
        got = parallel_backward(model, loss_fn, batch, ["cpu"] * 3, weights=[1, 2, 4])
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
        assert got.dtype == torch.float64 and got.device == torch.device("cpu")


def test_sequential_path_runs_each_nonempty_piece_on_the_model_itself() -> None:
    model = mlp(1)
    seen: list[tuple[nn.Module, int]] = []

    def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append((module, len(batch["x"])))
        return mean_loss(module, batch)

    parallel_backward(model, loss_fn, make_batch(1, 10), ["cpu"] * 3, weights=[1, 1000, 2])
    assert seen == [(model, 10)]  # the two empty pieces are not run
    seen.clear()
    parallel_backward(model, loss_fn, make_batch(1, 10), ["cpu"] * 3)
    assert seen == [(model, 4), (model, 3), (model, 3)]


def test_zero_items_change_nothing_in_a_window() -> None:
    """A call whose rows carry no loss adds no items and no gradient to the window."""
    ref, par = twins(mlp(5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = Accumulate(torch.optim.SGD(par.parameters(), lr=0.1), every=2)
    empty = make_batch(5, 6)
    empty["mask"] = torch.zeros(6)
    full = make_batch(6, 7)
    assert parallel_backward(par, masked, empty, ["cpu", "cpu"], opt=acc).item() == 0.0
    acc.step()
    acc.zero_grad()
    parallel_backward(par, masked, full, ["cpu", "cpu"], opt=acc)
    acc.step()
    reference_step(ref, ref_opt, full, "masked")
    assert_same_params(par, ref)


def test_docstring_example_runs() -> None:
    assert doctest.testmod(accumopt.parallel, raise_on_error=True).attempted >= 1


def _pretend_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def _vector_loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b["x"]), b["y"], reduction="none")


def _bad_items(m: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    return mse_sum(m, b["x"], b["y"]), -1.0


def _triple(m: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    return mse_sum(m, b["x"], b["y"]), 1, 2


def _mixed_kinds() -> Callable[[nn.Module, dict[str, torch.Tensor]], Any]:
    calls = iter(range(10))
    return lambda m, b: mean_loss(m, b) if next(calls) == 0 else sum_and_count(m, b)


def _on_meta() -> object:
    model = nn.Linear(4, 3, device="meta")
    return parallel_backward(model, mean_loss, make_batch(0, 4), ["cpu"])


def _under_no_grad() -> object:
    with torch.no_grad():
        return parallel_backward(mlp(0), mean_loss, make_batch(0, 4), ["cpu"])


ERRORS: list[tuple[str, Callable[[], object], bool, type[Exception], str]] = [
    (
        "opt not an Accumulate wrapper",
        lambda: parallel_backward(
            mlp(0),
            mean_loss,
            make_batch(0, 4),
            ["cpu"],
            opt=torch.optim.SGD(mlp(0).parameters(), lr=0.1),  # type: ignore[arg-type]
        ),
        False,
        TypeError,
        r"parallel_backward: opt is a SGD; expected an Accumulate wrapper",
    ),
    (
        "mixed CPU and CUDA",
        lambda: parallel_backward(mlp(0), mean_loss, make_batch(0, 4), ["cpu", "cuda:0"]),
        True,
        ValueError,
        r"devices=\['cpu', 'cuda:0'\] mix devices; expected one device listed any number",
    ),
    (
        "repeated CUDA device among others",
        lambda: parallel_backward(mlp(0), mean_loss, make_batch(0, 4), [0, 1, 0]),
        True,
        ValueError,
        r"devices=\['cuda:0', 'cuda:1', 'cuda:0'\] mix devices",
    ),
    (
        "model not on devices[0]",
        _on_meta,
        False,
        ValueError,
        r"model parameter 'weight' is on meta; expected every parameter and buffer on "
        r"devices\[0\]=cpu\. Call model\.to\('cpu'\) first",
    ),
    (
        "loss not a scalar",
        lambda: parallel_backward(mlp(0), _vector_loss, make_batch(0, 4), ["cpu", "cpu"]),
        False,
        TypeError,
        r"loss_fn returned a tensor of shape \(2, 3\) for piece 0 on cpu; expected a scalar",
    ),
    (
        "negative items",
        lambda: parallel_backward(mlp(0), _bad_items, make_batch(0, 4), ["cpu"]),
        False,
        ValueError,
        r"items=-1\.0 for piece 0 on cpu is not a finite number >= 0",
    ),
    (
        "tuple of three",
        lambda: parallel_backward(mlp(0), _triple, make_batch(0, 4), ["cpu"]),  # type: ignore[arg-type]
        False,
        TypeError,
        r"loss_fn returned a tuple of 3 for piece 0 on cpu; expected \(loss_sum, items\)",
    ),
    (
        "mixed result kinds",
        lambda: parallel_backward(mlp(0), _mixed_kinds(), make_batch(0, 4), ["cpu", "cpu"]),
        False,
        ValueError,
        r"returned a scalar for some pieces and \(loss_sum, items\) for others",
    ),
    (
        "gradients disabled",
        _under_no_grad,
        False,
        RuntimeError,
        r"parallel_backward: gradients are disabled",
    ),
    (
        "split errors surface",
        lambda: parallel_backward(mlp(0), mean_loss, make_batch(0, 2), ["cpu"] * 3),
        False,
        ValueError,
        r"micro_split: the batch has 2 rows for 3 devices",
    ),
]


@pytest.mark.parametrize(
    ("call", "pretend_cuda", "exc", "match"),
    [row[1:] for row in ERRORS],
    ids=[row[0] for row in ERRORS],
)
def test_errors(
    call: Callable[[], object],
    pretend_cuda: bool,
    exc: type[Exception],
    match: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if pretend_cuda:  # the device checks run before anything touches CUDA
        _pretend_cuda(monkeypatch)
    with pytest.raises(exc, match=match):
        call()


def test_rejected_call_leaves_the_window_alone() -> None:
    model = mlp(0)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    parallel_backward(model, mean_loss, make_batch(0, 4), ["cpu", "cpu"], opt=acc)
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        parallel_backward(model, _vector_loss, make_batch(1, 4), ["cpu", "cpu"], opt=acc)
    assert acc.micro_step == 1
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


def _cuda_equivalence(devices: list[str], weights: list[int] | None) -> None:
    for kind, loss_fn in LOSS_FNS.items():
        ref = mlp(11)
        par = copy.deepcopy(ref).to(devices[0])
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        acc = Accumulate(torch.optim.AdamW(par.parameters(), lr=0.01, weight_decay=0.1), every=2)
        batches = [make_batch(11, 9), make_batch(12, 14)]
        union = {k: torch.cat([b[k] for b in batches]) for k in ("x", "y", "mask")}
        reference_step(ref, ref_opt, union, kind)
        where: list[torch.device] = []

        def recording(
            module: nn.Module, batch: dict[str, Any], fn: Any = loss_fn, where: Any = where
        ) -> Any:
            device = batch["x"].device  # replicas hide .parameters(): look at the layer
            assert module[0].weight.device == device == batch["y"].device  # type: ignore[index]
            where.append(device)
            return fn(module, batch)

        for batch in batches:
            mean = parallel_backward(par, recording, batch, devices, weights=weights, opt=acc)
            assert mean.device == torch.device(devices[0])
            acc.step()
            acc.zero_grad()
        assert sorted(set(where), key=str) == sorted({torch.device(d) for d in devices}, key=str)
        assert_same_params(par.cpu(), ref, rtol=1e-9, atol=1e-11)


@CUDA
def test_cuda_one_device_equals_the_full_batch() -> None:
    _cuda_equivalence(["cuda:0"], None)
    _cuda_equivalence(["cuda:0", "cuda:0"], None)


@TWO_GPUS
def test_cuda_two_devices_equal_the_full_batch() -> None:
    _cuda_equivalence(["cuda:0", "cuda:1"], None)
    _cuda_equivalence(["cuda:0", "cuda:1"], [3, 1])


@pytest.mark.parametrize("count", [-3.0, float("nan"), float("inf")])
def test_a_bad_tensor_item_count_without_opt_is_refused_before_the_backward(count: float) -> None:
    """Without ``opt=``, a tensor count went unchecked: -n and NaN divided by 1 (the gradient
    n times too large), inf zeroed it, silently; a number was refused. Both are refused now."""
    model = mlp(91)
    x, y = data(91, 6)

    def loss_fn(m: nn.Module, batch: Any) -> Any:
        return mse_sum(m, *batch), torch.tensor(count, dtype=torch.float64)

    with pytest.raises(ValueError, match="parallel_backward: items"):
        parallel_backward(model, loss_fn, (x, y), ["cpu", "cpu"])
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_that_does_not_require_grad_without_opt_gets_accumopts_error() -> None:
    model = mlp(92)
    x, y = data(92, 6)
    with pytest.raises(ValueError, match="parallel_backward: the loss does not require grad"):
        parallel_backward(model, lambda m, b: mse_sum(m, *b).detach(), (x, y), ["cpu", "cpu"])

"""The squared norms behind the noise scale (``accumopt.noise.SquaredNorm``): equal to a float64
sum of squares for any mix of shapes, dtypes and layouts, planned once and planned again when
the gradients change; on a CPU model of many small tensors no norm per tensor is taken; and
one window's estimate equals the formula applied to hand-computed norms."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accumopt import Accumulate
from accumopt.noise import NoiseScale, SquaredNorm

SHAPES = st.lists(
    st.sampled_from([(), (0,), (1,), (3,), (16,), (4, 4), (16, 16), (2, 3, 5), (3, 0)]),
    min_size=1,
    max_size=40,
)


def reference(grads: list[torch.Tensor]) -> float:
    """The sum of squares in float64, one element at a time (sparse: coalesced values)."""
    dense = [g.coalesce().values() if g.is_sparse else g for g in grads]
    return sum(float(g.double().square().sum()) for g in dense)


@settings(max_examples=60, deadline=None)
@given(shapes=SHAPES, dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 9))
def test_any_shapes_give_the_float64_sum_of_squares(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    sq = SquaredNorm()(grads)
    assert sq.dtype == dtype and sq.dim() == 0
    rel = 1e-14 if dtype == torch.float64 else 1e-6
    assert float(sq) == pytest.approx(reference(grads), rel=rel, abs=1e-300)


@pytest.mark.parametrize(
    "case",
    ["float32+float64", "bf16", "fp16+float32", "sparse", "large", "non-contiguous"],
)
def test_mixed_dtypes_layouts_and_sizes(case: str) -> None:
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    grads, dtype, rel = {
        "float32+float64": ([r(4, 4), r(4, 4, dtype=torch.float64), r(3)], torch.float64, 1e-7),
        "bf16": ([r(16, 16).bfloat16(), r(16).bfloat16()], torch.float32, 1e-6),
        "fp16+float32": ([r(8, 8).half(), r(8, 8), r(2)], torch.float32, 1e-6),
        "sparse": ([r(5, 3), r(6, 4).to_sparse(), r(3)], torch.float32, 1e-6),
        "large": ([r(1100, 1000), r(7)], torch.float32, 1e-3),  # > 2**20 elements: the norms
        "non-contiguous": ([r(6, 5).t(), r(5, 6), r(4, 8)[:, ::2]], torch.float32, 1e-6),
    }[case]
    sq = SquaredNorm()(grads)
    assert sq.dtype == dtype
    assert float(sq) == pytest.approx(reference(grads), rel=rel)


def test_the_loss_scale_is_divided_out_squared() -> None:
    grads = [torch.full((3,), 2.0), torch.full((2, 2), 2.0)]  # sum of squares 28
    assert float(SquaredNorm()(grads, torch.tensor(4.0, dtype=torch.float32))) == 28 / 16


def test_complex_gradients_are_refused_as_before() -> None:
    with pytest.raises(RuntimeError):
        SquaredNorm()([torch.randn(3, dtype=torch.complex64)])


def test_a_plan_that_no_longer_fits_is_made_again_and_stays_exact() -> None:
    sq = SquaredNorm()
    first = [torch.randn(4, 4), torch.randn(4), torch.randn(4, 4)]
    assert float(sq(first)) == pytest.approx(reference(first), rel=1e-14)
    # same count, other shapes: the planned stacks no longer fit (another pass over the
    # shapes), or fit with other sizes (a one-tensor stack): the sum stays exact either way
    for grads in (
        [torch.randn(4), torch.randn(4, 4), torch.randn(4, 4)],
        [torch.randn(9, 2), torch.randn(4), torch.randn(9, 2)],
        [torch.randn(9, 2), torch.randn(30), torch.randn(9, 2)],
        [torch.randn(2000, 600), torch.randn(4), torch.randn(2000, 600)],  # now too large
        [torch.randn(4, 4), torch.randn(4), torch.randn(4, 4)],
    ):
        assert float(sq(grads)) == pytest.approx(reference(grads), rel=1e-12)


def test_many_small_cpu_tensors_take_no_norm_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost target of the noise scale: on a CPU the norms run one by one (about 1.5 us
    per tensor); small gradients are stacked by shape instead."""
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)])
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.1),
        every=4,
        noise_scale=NoiseScale(every_windows=1),
    )
    calls: list[int] = []
    original = torch._foreach_norm

    def counting(tensors: Any, *a: Any, **k: Any) -> Any:
        calls.append(len(tensors))
        return original(tensors, *a, **k)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    for _ in range(12):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert calls == []
    assert opt.noise_scale is not None and opt.noise_scale.windows == 3


def test_only_measured_windows_take_squared_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(8, 8)
    est = NoiseScale(every_windows=3)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2, noise_scale=est)
    per_window: list[int] = []
    calls = [0]
    original = SquaredNorm.__call__

    def counting(self: SquaredNorm, *a: Any) -> Any:
        calls[0] += 1
        return original(self, *a)

    monkeypatch.setattr(SquaredNorm, "__call__", counting)
    for _ in range(6):
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        per_window.append(calls[0])
        calls[0] = 0
    assert per_window == [2, 0, 0, 2, 0, 0]


def test_one_window_equals_the_formula_on_hand_computed_norms() -> None:
    """Items-weighted window of 3 micro-batches of 2, 3 and 5 items (float64): the estimate's
    unsmoothed (tr(Σ), |G|²) is the paper's formula on |G_small|² (first micro-step's mean)
    and |G_big|² (the window's mean), to rounding."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(7, 3))
    opt = Accumulate(
        torch.optim.SGD([w], lr=0.0), every=3, noise_scale=NoiseScale(decay=None, every_windows=1)
    )
    rows = [torch.randn(n, 7, 3) for n in (2, 3, 5)]
    for z in rows:
        opt.backward(((w - z) ** 2).sum(), items=len(z))
        opt.step()
        opt.zero_grad()
    g_small = 2 * (w.detach() - rows[0]).mean(0)
    g_big = 2 * (w.detach() - torch.cat(rows)).mean(0)
    small, big, b_small, b_big = float(g_small.square().sum()), float(g_big.square().sum()), 2, 10
    trace = (small - big) / (1 / b_small - 1 / b_big)
    grad = (b_big * big - b_small * small) / (b_big - b_small)
    assert opt.noise_scale is not None and opt.noise_scale.last is not None
    assert opt.noise_scale.last == pytest.approx((trace, grad), rel=1e-12)
    assert opt.noise_scale.batch_per_micro_step == pytest.approx(10 / 3)

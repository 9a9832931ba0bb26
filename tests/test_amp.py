"""Point 8 (AMP): torch's GradScaler loop on every micro-step equals the non-accumulated loop.

``torch.amp.GradScaler("cpu")`` is enabled on CPU, so the whole scaler contract (per-micro-step
``scaler.step``/``update``, inf/NaN skipping, scale growth and backoff) runs here in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from torch import nn

from accumopt import Accumulate

OPTS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


def scaler(growth_interval: int = 1) -> torch.amp.GradScaler:
    # growth_interval=1 doubles the scale after every clean micro-step: the scale changes
    # inside every window, the trap that per-micro-step scaler.update() sets.
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=growth_interval)


def amp_window(
    acc: Accumulate,
    sc: torch.amp.GradScaler,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    sizes: list[int],
    poison: int | None = None,
) -> list[float]:
    scales = []
    for i, (xb, yb) in enumerate(zip(x.split(sizes), y.split(sizes))):
        loss = mse_sum(model, xb, yb)
        if i == poison:
            loss = loss * float("inf")
        acc.backward(sc.scale(loss), items=len(xb))
        sc.step(acc)
        sc.update()
        acc.zero_grad()
        scales.append(sc.get_scale())
    return scales


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_8_amp_scale_change_inside_window_is_exact(opt_name: str) -> None:
    ref, model = twins(mlp(30))
    ref_opt = OPTS[opt_name](list(ref.parameters()))
    sc = scaler()
    acc = Accumulate(OPTS[opt_name](list(model.parameters())), every=4, scaler=sc)
    for w in range(3):
        x, y = data(300 + w, 10)
        full_batch_step(ref, ref_opt, x, y)
        scales = amp_window(acc, sc, model, x, y, [3, 1, 4, 2])
        assert len(set(scales)) == 4  # the scale changed at every micro-step of the window
        assert acc.did_update
        assert_same_params(model, ref)


@pytest.mark.parametrize("poison", [0, 1, 3])  # first, middle, last micro-step
def test_8_amp_inf_skips_the_window_then_training_resumes(poison: int) -> None:
    ref, model = twins(mlp(31))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    sc = scaler(growth_interval=1000)
    acc = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.01), every=4, scaler=sc)
    x, y = data(31, 8)
    before = copy.deepcopy(model)
    scales = amp_window(acc, sc, model, x, y, [2, 2, 2, 2], poison=poison)
    assert not acc.did_update and acc.updates == 0 and acc.micro_step == 0
    assert_same_params(model, before, rtol=0, atol=0)
    # backed off once, on the bad micro-step (not again at the boundary of the window holding it)
    assert scales == [2.0**8] * poison + [2.0**7] * (4 - poison)
    assert all(p.grad is None for p in model.parameters())
    x2, y2 = data(32, 8)
    full_batch_step(ref, ref_opt, x2, y2)
    amp_window(acc, sc, model, x2, y2, [2, 2, 2, 2])
    assert acc.did_update and acc.updates == 1
    assert_same_params(model, ref)


def test_8_amp_gated_pattern_of_the_pytorch_amp_notes() -> None:
    """scaler.step/update only at the boundary (PyTorch's AMP recipe) is exact too."""
    ref, model = twins(mlp(33))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, scaler=sc)
    for w in range(2):
        x, y = data(330 + w, 6)
        full_batch_step(ref, ref_opt, x, y)
        for xb, yb in zip(x.split(2), y.split(2)):
            sc.scale(mse_sum(model, xb, yb) / 2).backward()
            if acc.will_update:
                sc.step(acc)
                sc.update()
                acc.zero_grad()
        assert acc.did_update
        assert_same_params(model, ref)


def test_8_amp_gated_recipe_flushes_its_last_partial_window_through_the_scaler() -> None:
    """PyTorch's recipe without scaler=: flush(scaler) applies a short last window unscaled
    (the reference divides it by its own micro-steps); flush() alone is refused there."""
    ref, model = twins(mlp(35))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sc, sc = scaler(), scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    x, y = data(35, 10)
    xs, ys = x.split(2), y.split(2)  # 5 micro-batches: a window of 3, then one of 2
    for start, stop in ((0, 3), (3, 5)):
        for xb, yb in zip(xs[start:stop], ys[start:stop]):
            ref_sc.scale(mse_sum(ref, xb, yb) / (2 * (stop - start))).backward()
        ref_sc.step(ref_opt)
        ref_sc.update()
        ref_opt.zero_grad()
    for xb, yb in zip(xs, ys):
        sc.scale(mse_sum(model, xb, yb) / 2).backward()
        if acc.will_update:
            sc.step(acc)
            sc.update()
            acc.zero_grad()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"call opt.flush\(scaler\)"):
        acc.flush()
    assert acc.micro_step == 2 and all(
        torch.equal(p.grad, g) for p, g in zip(model.parameters(), before)
    )
    assert acc.flush(sc) and acc.updates == 2
    assert sc.get_scale() == ref_sc.get_scale()
    assert all(p.grad is None for p in model.parameters())
    assert_same_params(model, ref)


def test_8_amp_user_unscale_and_clip_at_boundary_sees_window_gradient() -> None:
    ref, model = twins(mlp(34))
    x, y = data(34, 8)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (mse_sum(ref, x, y) / 8).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.5), every=4, scaler=sc)
    for xb, yb in zip(x.split(2), y.split(2)):
        acc.backward(sc.scale(mse_sum(model, xb, yb)), items=2)
        if acc.will_update:
            sc.unscale_(acc)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            torch.testing.assert_close(norm, ref_norm)
        sc.step(acc)
        sc.update()
        acc.zero_grad()
    assert_same_params(model, ref)


def test_8_amp_max_grad_norm_unscales_once() -> None:
    ref, model = twins(mlp(35))
    x, y = data(35, 8)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (mse_sum(ref, x, y) / 8).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    sc = scaler()
    acc = Accumulate(
        torch.optim.SGD(model.parameters(), lr=0.5), every=4, scaler=sc, max_grad_norm=0.05
    )
    amp_window(acc, sc, model, x, y, [2, 2, 2, 2])
    assert_same_params(model, ref)


def test_8_amp_flush_of_a_partial_window() -> None:
    ref, model = twins(mlp(36))
    x, y = data(36, 5)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4, scaler=sc)
    amp_window(acc, sc, model, x, y, [3, 2])
    assert acc.flush()
    assert_same_params(model, ref)


def test_8_amp_checkpoint_mid_window_carries_the_buffer() -> None:
    x, y = data(37, 8)
    sizes = [2, 2, 2, 2]

    def run(stop: int | None) -> nn.Module:
        model = mlp(37)
        sc = scaler()
        acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every=4, scaler=sc)
        if stop is None:
            amp_window(acc, sc, model, x, y, sizes)
            return model
        amp_window(acc, sc, model, x[: 2 * stop], y[: 2 * stop], sizes[:stop])
        saved = copy.deepcopy(
            {"m": model.state_dict(), "o": acc.state_dict(), "s": sc.state_dict()}
        )
        model2 = mlp(1)
        sc2 = torch.amp.GradScaler("cpu")
        acc2 = Accumulate(torch.optim.Adam(model2.parameters(), lr=0.01), every=4, scaler=sc2)
        model2.load_state_dict(saved["m"])
        acc2.load_state_dict(saved["o"])
        sc2.load_state_dict(saved["s"])
        amp_window(acc2, sc2, model2, x[2 * stop :], y[2 * stop :], sizes[stop:])
        return model2

    whole = run(None)
    for stop in (1, 2, 3):
        assert_same_params(run(stop), whole, rtol=0, atol=0)


def test_8_amp_boundary_step_outside_the_scaler_is_refused() -> None:
    model = mlp(39)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=1, scaler=sc)
    x, y = data(39, 2)
    sc.scale(mse_sum(model, x, y)).backward()
    with pytest.raises(RuntimeError, match=r"scaler.step\(opt\)"):
        acc.step()
    sc.step(acc)  # nothing was lost: the proper call still applies the update
    sc.update()
    assert acc.did_update


def amp_setup(
    seed: int, every: int, rows: int
) -> tuple[nn.Module, nn.Module, torch.amp.GradScaler, Accumulate, torch.Tensor, torch.Tensor]:
    """A model, its untouched copy, a scaler, the model's wrapper (SGD, ``every``) and data."""
    model = mlp(seed)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=every, scaler=sc)
    return model, copy.deepcopy(model), sc, acc, *data(seed, rows)


WIPES = {
    "model.zero_grad()": lambda model: model.zero_grad(),
    "p.grad.zero_()": lambda model: [p.grad.zero_() for p in model.parameters()],
}


@pytest.mark.parametrize("wipe", WIPES)
def test_8_amp_gated_recipe_with_a_wipe_every_micro_step_is_refused(wipe: str) -> None:
    """PyTorch's gated AMP recipe (``scaler.step`` at the boundary only) with the window's
    ``.grad`` cleared after every micro-step: refused at the close, before any update (the
    parameters are untouched), with the wipe named; ``opt.discard()`` recovers."""
    model, before, sc, acc, x, y = amp_setup(35, 3, 6)
    with pytest.raises(RuntimeError, match="replaced or cleared"):
        for xb, yb in zip(x.split(2), y.split(2)):
            sc.scale(mse_sum(model, xb, yb) / 2).backward()
            if acc.will_update:
                sc.step(acc)
                sc.update()
            WIPES[wipe](model)
    assert acc.updates == 0
    assert_same_params(model, before)
    acc.discard()
    ref = copy.deepcopy(model)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    for xb, yb in zip(x.split(2), y.split(2)):  # the same loop without the wipe: exact
        sc.scale(mse_sum(model, xb, yb) / 2).backward()
        if acc.will_update:
            sc.step(acc)
            sc.update()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_8_amp_a_wipe_before_a_fold_inside_the_window_is_refused_there() -> None:
    """Two gated micro-steps, a wipe, then another micro-step and ``scaler.step`` inside the
    window: the fold would take the wiped ``.grad`` into the window; it is refused at the
    micro-step after the wipe, and ``scaler.step`` refuses too."""
    model, _, sc, acc, x, y = amp_setup(36, 4, 8)
    parts = list(zip(x.split(2), y.split(2)))
    for xb, yb in parts[:2]:
        sc.scale(mse_sum(model, xb, yb) / 2).backward()
    model.zero_grad()
    with pytest.raises(RuntimeError, match="replaced or cleared"):  # at the next pass's end
        sc.scale(mse_sum(model, *parts[2]) / 2).backward()
    with pytest.raises(RuntimeError, match="cleared or replaced outside the wrapper"):
        sc.step(acc)
    assert acc.updates == 0


def test_8_amp_zero_grad_of_the_model_after_each_scaler_step_is_exact() -> None:
    """With ``scaler.step`` on every micro-step (accumopt's AMP loop) the window is folded out
    of ``.grad`` at each step: a ``model.zero_grad()`` after it clears nothing of the window, is
    not refused, and the run equals the full-batch step."""
    ref, model = twins(mlp(37))
    x, y = data(37, 6)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3, scaler=sc)
    for xb, yb in zip(x.split(2), y.split(2)):
        sc.scale(mse_sum(model, xb, yb) / 2).backward()
        sc.step(acc)
        sc.update()
        model.zero_grad()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_8_amp_a_wipe_between_backward_and_scaler_step_is_refused() -> None:
    """accumopt's AMP loop (``scaler.step`` on every micro-step) with ``.grad`` cleared between
    a micro-step's backward pass and its ``scaler.step``: that micro-step would be lost from
    the window; its ``scaler.step`` refuses, and nothing is applied."""
    model, before, sc, acc, x, y = amp_setup(38, 3, 6)
    with pytest.raises(RuntimeError, match="replaced or cleared"):
        for i, (xb, yb) in enumerate(zip(x.split(2), y.split(2))):
            sc.scale(mse_sum(model, xb, yb) / 2).backward()
            if i == 1:
                model.zero_grad()
            sc.step(acc)
            sc.update()
    assert acc.updates == 0 and acc.micro_step == 2
    assert_same_params(model, before)


@pytest.mark.parametrize("how", ["buffer=True", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "step_every_micro_step"])
def test_8_amp_a_wipe_of_buffered_parameters_is_refused(how: str, gated: bool) -> None:
    """Under a GradScaler the parameters the window buffer holds (``buffer=True``, bf16
    parameters) also wait in ``.grad`` until
    ``scaler.step``: a ``model.zero_grad()`` between micro-steps (gated recipe), or between a
    backward pass and its ``scaler.step``, is refused, not trained through (rel 0.06-0.5)."""
    model = mlp(39) if how != "bf16" else mlp(39).to(torch.bfloat16)
    options = {"buffer=True": {"buffer": True}}
    sc = scaler()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulate(inner, every=3, scaler=sc, **options.get(how, {}))
    x, y = data(39, 6)
    dtype = next(model.parameters()).dtype
    with pytest.raises(RuntimeError, match="replaced or cleared"):
        for xb, yb in zip(x.split(2), y.split(2)):
            sc.scale(mse_sum(model, xb.to(dtype), yb.to(dtype)).float() / 2).backward()
            if not acc.will_update:
                model.zero_grad()
            if not gated or acc.will_update:
                sc.step(acc)
                sc.update()
    assert acc.updates == 0


def gated_window_with_a_wipe(how: str) -> None:
    """Four micro-steps of PyTorch's gated AMP recipe over a buffered float64 MLP; after the
    second one the wrapper is copied (``copy.deepcopy`` of model, wrapper and scaler),
    reloaded under a fresh GradScaler whose scale is made later, or switched to rollback
    (``enable_rollback()``); after the third one ``model.zero_grad()`` wipes the window."""
    model, _, sc, acc, x, y = amp_setup(40, 4, 8)
    if how == "reloaded":
        acc = Accumulate(
            torch.optim.SGD(model.parameters(), lr=0.1), every=4, scaler=sc, buffer=True
        )
    for k, (xb, yb) in enumerate(zip(x.split(2), y.split(2))):
        sc.scale(mse_sum(model, xb, yb) / 2).backward()
        if k == 1 and how == "copied":
            model, acc, sc = copy.deepcopy((model, acc, sc))
        elif k == 1 and how == "reloaded":
            saved = copy.deepcopy(
                {"m": model.state_dict(), "o": acc.state_dict(), "s": sc.state_dict()}
            )
            model = mlp(40)
            sc = scaler()
            sc.load_state_dict(saved["s"])  # its scale is made at the next scale()
            acc = Accumulate(
                torch.optim.SGD(model.parameters(), lr=0.1), every=4, scaler=sc, buffer=True
            )
            model.load_state_dict(saved["m"])
            acc.load_state_dict(saved["o"])
        elif k == 1:
            acc.enable_rollback()
        if k == 2:
            model.zero_grad()
        if acc.will_update:
            sc.step(acc)
            sc.update()


@pytest.mark.parametrize("how", ["copied", "reloaded", "rollback"])
def test_8_amp_a_wipe_after_a_copy_a_reload_or_rollback_is_refused(how: str) -> None:
    """The window's ``.grad`` is noted again where it is rebuilt or rerouted mid-window: a
    deep copy of the wrapper, a checkpoint loaded before the new scaler made its scale (the
    buffered parameters too), ``enable_rollback()`` under AMP (nothing is folded there). A
    later wipe is refused at the close, not trained through (rel 0.03 before)."""
    with pytest.raises(RuntimeError, match="replaced or cleared"):
        gated_window_with_a_wipe(how)


def test_8_amp_rollback_after_a_reload_under_a_fresh_scaler_keeps_the_scaled_window() -> None:
    """A gated AMP window reloaded under a fresh GradScaler (no scale made yet) holds scaled
    micro-steps in ``.grad`` that wait for ``scaler.step``; ``enable_rollback()`` then must
    not fold them unscaled into the buffer (rel 36 two commits ago, a false wipe refusal one
    commit ago): the window ends as the uninterrupted one."""
    ref, model = twins(mlp(43))
    x, y = data(43, 8)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    sc = scaler()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4, scaler=sc)
    for k, (xb, yb) in enumerate(zip(x.split(2), y.split(2))):
        sc.scale(mse_sum(model, xb, yb) / 2).backward()
        if acc.will_update:
            sc.step(acc)
            sc.update()
        if k == 1:
            saved = copy.deepcopy(
                {"m": model.state_dict(), "o": acc.state_dict(), "s": sc.state_dict()}
            )
            model, sc = mlp(43), scaler()
            sc.load_state_dict(saved["s"])
            acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4, scaler=sc)
            model.load_state_dict(saved["m"])
            acc.load_state_dict(saved["o"])
            acc.enable_rollback()
    assert acc.updates == 1
    assert_same_params(model, ref)

"""Hugging Face Accelerate (accumopt.integrations.accelerate) and timm-style GradScaler loops.

Every exactness claim is float64 SGD against the same loop at the full effective batch
without accumulation: rel = ||theta - theta_full|| / ||theta_full - theta_0|| <= 1e-12. The
2-rank DDP scenarios run in one spawn of 2 gloo processes (Accelerate reads the rank from the
environment, as under torchrun, and uses the process group accumopt.testing initialised).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from accumopt import Accumulate

sys.path.insert(0, os.path.dirname(__file__))

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    from accumopt.integrations import accelerate as acc
except ImportError:  # the timm-style test below runs without it
    accelerate = None

needs_accelerate = pytest.mark.skipif(
    accelerate is None,
    reason='Hugging Face Accelerate is not installed: pip install "accumopt[accelerate]"',
)
F64 = torch.float64
EVERY, MICRO, LR = 4, 5, 0.1  # single process: windows of 4 micro-batches of 5 rows


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 6, dtype=F64), nn.Tanh(), nn.Linear(6, 3, dtype=F64))


def dataset(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Rows (x, y, mask): a masked regression; the mask's ones are the items ("tokens")."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g, dtype=F64), torch.randn(n, 3, generator=g, dtype=F64)
    mask = (torch.rand(n, 3, generator=g, dtype=F64) < 0.7).to(F64)
    return torch.utils.data.TensorDataset(x, y, mask)


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (((model(x) - y) ** 2) * m).sum()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rel(theta: torch.Tensor, full: torch.Tensor) -> float:
    return float((theta - full).norm() / (full - flat(net())).norm())


def fresh(**kwargs: Any) -> Any:
    """A new Accelerator on CPU (Accelerate keeps process-wide state; start from none)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


@pytest.fixture
def clean_accelerate() -> Iterator[None]:
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def full_batch(
    ds: Any, batch: int, gamma: float = 0.5, weighted: bool = True, clip: float | None = None
) -> tuple[torch.Tensor, list[float]]:
    """The reference: the plain Accelerate loop at the full effective batch, no accumulation
    (one process; the mean loss over the batch's items, or over its rows)."""
    accelerator = fresh()
    model, loader = net(), torch.utils.data.DataLoader(ds, batch_size=batch)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=gamma)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    lrs = []
    for x, y, m in loader:
        accelerator.backward(loss_sum(model, x, y, m) / (m.sum() if weighted else m.numel()))
        if clip is not None:
            accelerator.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    return flat(model), lrs


def prepared(ds: Any, accelerator: Any, every: int = EVERY, micro: int = MICRO, **kw: Any) -> Any:
    """The recipe's setup: Accumulate built before prepare, everything prepared in one call."""
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), every=every, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    loader = torch.utils.data.DataLoader(ds, batch_size=micro)
    model, optimizer, loader, sched = acc.prepare(accelerator, model, opt, loader, sched)
    return model, opt, optimizer, loader, sched


def train(
    accelerator: Any,
    run: Any,
    weighted: bool = True,
    lrs: list[float] | None = None,
    stop: int | None = None,
    skip: int = 0,
) -> None:
    """The recipe's loop over ``run`` (from :func:`prepared`); ``stop``: leave after that many
    micro-batches (mid-window, no flush); ``skip``: resume after that many."""
    model, opt, optimizer, loader, sched = run
    if skip:
        loader = accelerator.skip_first_batches(loader, skip)
    for i, (x, y, m) in enumerate(loader):
        if i == stop:
            return
        if weighted:
            opt.next_items(m.sum())  # the items ("tokens") of this micro-batch
            accelerator.backward(loss_sum(model, x, y, m))
        else:
            accelerator.backward(loss_sum(model, x, y, m) / m.numel())
        optimizer.step()
        sched.step()  # AcceleratedScheduler: steps only when the optimizer updated
        optimizer.zero_grad()
        assert sched.scheduler.last_epoch == opt.updates * accelerator.num_processes
        assert accelerator.optimizer_step_was_skipped == (not opt.did_update)
        if opt.did_update and lrs is not None:
            lrs.append(sched.get_last_lr()[0])
    if opt.flush():  # the short last window, exact
        sched.step()
        if lrs is not None:
            lrs.append(sched.get_last_lr()[0])


@needs_accelerate
@pytest.mark.parametrize(("weighted", "n"), [(True, 63), (False, 50)])
def test_accelerate_one_call_prepare_is_exact_with_ragged_and_flushed_windows(
    clean_accelerate: None, weighted: bool, n: int
) -> None:
    """63 rows: 3 windows of 4 x 5 rows, then one micro-batch of 3 (ragged, flushed), weighted
    by its mask's ones. 50 rows of mean losses: 2 windows, then a flushed window of 2."""
    ds = dataset(n)
    expected, expected_lrs = full_batch(ds, EVERY * MICRO, weighted=weighted)
    accelerator, lrs = fresh(), []
    run = prepared(ds, accelerator)
    assert isinstance(run[2], acc.AcceleratedAccumulate) and run[1].model is run[0]
    train(accelerator, run, weighted, lrs)
    assert rel(flat(run[0]), expected) <= 1e-12
    assert lrs == expected_lrs and run[1].updates == len(expected_lrs)


@needs_accelerate
def test_accelerate_save_state_mid_window_resumes_bit_for_bit(
    clean_accelerate: None, tmp_path: Any
) -> None:
    """Saved after 6 micro-batches (window 2 at micro-step 2), loaded into a new run."""
    ds = dataset(63)
    accelerator = fresh()
    whole = prepared(ds, accelerator)
    train(accelerator, whole)
    accelerator = fresh()
    first = prepared(ds, accelerator)
    train(accelerator, first, stop=6)
    assert (first[1].micro_step, first[1].updates) == (2, 1)
    accelerator.save_state(str(tmp_path))
    accelerator = fresh()  # as a new process would
    second = prepared(ds, accelerator)
    accelerator.load_state(str(tmp_path))
    assert (second[1].micro_step, second[1].updates) == (2, 1)
    train(accelerator, second, skip=6)
    assert torch.equal(flat(second[0]), flat(whole[0]))
    assert second[4].state_dict() == whole[4].state_dict()
    assert second[1].updates == whole[1].updates == 4


@needs_accelerate
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_accelerate_own_accumulation_is_refused_at_prepare(
    clean_accelerate: None, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "environment":
        monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    accelerator = fresh(**({"gradient_accumulation_steps": 4} if how == "argument" else {}))
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every=4)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4\).*1/4 of the right"):
        acc.prepare(accelerator, model, opt)
    with pytest.raises(ValueError, match=r"Expected gradient_accumulation_steps=1.*every=4\)"):
        acc.prepare(accelerator, model, opt)


@needs_accelerate
def test_accelerate_accumulation_switched_on_after_prepare_is_refused_before_any_update(
    clean_accelerate: None,
) -> None:
    accelerator = fresh()
    run = prepared(dataset(20), accelerator)
    model, opt, optimizer, loader, _ = run
    accelerator.gradient_accumulation_steps = 4
    before = flat(model)
    x, y, m = next(iter(loader))
    with accelerator.accumulate(model):
        opt.next_items(m.sum())
        with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps > 1 accumulates"):
            accelerator.backward(loss_sum(model, x, y, m))  # the core sees the sync off
        with pytest.raises(RuntimeError, match="discard"):
            optimizer.step()
    assert opt.updates == 0 and torch.equal(flat(model), before)


@needs_accelerate
def test_accelerate_accumulation_steps_without_its_context_are_refused_before_any_update(
    clean_accelerate: None,
) -> None:
    """``accelerator.backward`` divides every loss by ``gradient_accumulation_steps`` even
    outside ``accelerator.accumulate()``: a stock ``prepare`` around a wrapper and a loop
    without that context made every update 1/4 of the right one, silently."""
    accelerator = fresh(gradient_accumulation_steps=4)
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every=EVERY)
    model, optimizer, loader = accelerator.prepare(
        model, opt, torch.utils.data.DataLoader(dataset(20), batch_size=MICRO)
    )
    before = flat(model)
    x, y, m = next(iter(loader))
    with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps > 1 accumulates"):
        accelerator.backward(loss_sum(model, x, y, m) / m.sum())
    with pytest.raises(RuntimeError, match="discard"):
        optimizer.step()
    assert opt.updates == 0 and torch.equal(flat(model), before)


@needs_accelerate
@pytest.mark.parametrize("how", ["accelerator.clip_grad_norm_", "max_grad_norm"])
def test_accelerate_clipping_is_exact_at_the_boundary_and_refused_inside_the_window(
    clean_accelerate: None, how: str
) -> None:
    ds = dataset(40)  # two windows
    expected, _ = full_batch(ds, EVERY * MICRO, clip=0.05)
    accelerator = fresh()
    kw = {"max_grad_norm": 0.05} if how == "max_grad_norm" else {}
    model, opt, optimizer, loader, sched = prepared(ds, accelerator, **kw)
    for x, y, m in loader:
        opt.next_items(m.sum())
        accelerator.backward(loss_sum(model, x, y, m))
        if opt.will_update and how != "max_grad_norm":
            accelerator.clip_grad_norm_(model.parameters(), 0.05)
        elif not opt.will_update:  # the usual `if accelerator.sync_gradients:` would clip here
            with pytest.raises(RuntimeError, match=r"partial sum.*Nothing was clipped"):
                accelerator.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        sched.step()
        optimizer.zero_grad()
    assert opt.updates == 2 and rel(flat(model), expected) <= 1e-12


@needs_accelerate
@pytest.mark.parametrize("how", ["an inner pre-hook", "max_grad_norm"])
def test_accelerate_clipping_once_per_update_reaches_the_window_flush_applies(
    clean_accelerate: None, how: str
) -> None:
    """The short last window, applied by ``flush()``, is clipped like the others through
    ``max_grad_norm=`` or a step pre-hook of the inner optimizer (clipping under
    ``if opt.will_update:`` in the loop never sees it: the README says so)."""
    ds = dataset(50)  # two windows of 20 rows, then a short one of 10
    expected, _ = full_batch(ds, EVERY * MICRO, clip=0.05)
    accelerator = fresh()
    kw = {"max_grad_norm": 0.05} if how == "max_grad_norm" else {}
    model, opt, optimizer, loader, sched = prepared(ds, accelerator, **kw)
    if how == "an inner pre-hook":
        params = list(model.parameters())

        def clip(*_: Any) -> None:  # a pre-hook returns None
            torch.nn.utils.clip_grad_norm_(params, 0.05)

        opt.optimizer.register_step_pre_hook(clip)
    for x, y, m in loader:
        opt.next_items(m.sum())
        accelerator.backward(loss_sum(model, x, y, m))
        optimizer.step()
        sched.step()
        optimizer.zero_grad()
    assert opt.updates == 2 and opt.flush() and opt.updates == 3
    assert rel(flat(model), expected) <= 1e-12


@needs_accelerate
def test_accelerate_prepare_in_several_calls_wires_in_either_order(clean_accelerate: None) -> None:
    accelerator = fresh()
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every=2)
    optimizer = acc.prepare(accelerator, opt)  # the model comes later
    assert isinstance(optimizer, acc.AcceleratedAccumulate) and opt.model is None
    model = acc.prepare(accelerator, model)
    assert opt.model is model
    accelerator = fresh()  # a wrapper prepared by plain accelerator.prepare: refused
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every=2)
    accelerator.prepare(opt)
    with pytest.raises(ValueError, match=r"prepared by accelerator.prepare itself"):
        acc.prepare(accelerator, model)
    accelerator = fresh()  # one wrapper over two prepared models: refused
    a, b = net(), nn.Linear(3, 1, dtype=F64)
    opt = Accumulate(torch.optim.SGD([*a.parameters(), *b.parameters()], lr=LR), every=2)
    with pytest.raises(ValueError, match=r"2 prepared models.*expected one"):
        acc.prepare(accelerator, a, b, opt)


@needs_accelerate
def test_accelerate_grad_scaler_path_is_exact_through_a_scale_change(
    clean_accelerate: None,
) -> None:
    """Accelerate's fp16 path (AcceleratedOptimizer.step = scaler.step + scaler.update on
    every micro-step, accelerator.backward scales), run on CPU with a CPU GradScaler whose scale
    doubles after every micro-step: inside every window the scale changes. The wrapper is given
    ``scaler=accelerator.scaler``; without it, prepare refuses (the 0.2 core no longer adopts a
    scaler it finds on the call stack)."""
    ds = dataset(63)
    expected, expected_lrs = full_batch(ds, EVERY * MICRO)
    accelerator = fresh()
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    with pytest.raises(ValueError, match=r"scaler=accelerator.scaler"):
        prepared(ds, accelerator)
    run, lrs = prepared(ds, accelerator, scaler=accelerator.scaler), []
    train(accelerator, run, lrs=lrs)
    assert accelerator.scaler.get_scale() == 2.0 ** (8 + 13)
    assert rel(flat(run[0]), expected) <= 1e-12 and lrs == expected_lrs


# --- 2 ranks: DDP through Accelerate (one spawn of 2 gloo processes for all scenarios) -------

WORLD, DDP_EVERY, DDP_MICRO = 2, 3, 4  # an update: 2 ranks x 3 micro-batches x 4 rows
DDP_ROWS = 2 * 24 + 3 * 4 + 1  # 2 windows, then 2 micro-steps per rank, the last of 1 row
DDP_STOP = 4  # the resumed run is saved after 4 micro-steps per rank (mid-window)


def ddp_accelerator() -> Any:
    """Accelerate on this rank, as torchrun would set it up (the gloo group exists already).
    even_batches=False: the 1-row last batch stays ragged (even_batches pads it with rows from
    the start of the data, as Accelerate does without accumopt too)."""
    rank = str(torch.distributed.get_rank())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    os.environ.update(LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    config = DataLoaderConfiguration(even_batches=False)
    return Accelerator(cpu=True, dataloader_config=config)


def count_all_reduces(model: Any) -> dict[str, int]:
    """DDP's gradient all-reduces (a communication hook: "ddp"), and every gradient-sized
    all-reduce, DDP's or accumopt's own (torch.distributed.all_reduce patched: "gradient")."""
    calls = {"ddp": 0, "gradient": 0}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations
        calls["ddp"] += 1
        work = torch.distributed.all_reduce(bucket.buffer(), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0] / WORLD)

    model.register_comm_hook(None, hook)
    return calls


def ddp_run(weighted: bool, rows: int, stop: int | None = None) -> dict[str, Any]:
    accelerator = ddp_accelerator()
    run = prepared(dataset(rows), accelerator, every=DDP_EVERY, micro=DDP_MICRO)
    calls, lrs = count_all_reduces(run[0]), []
    size = sum(p.numel() for p in run[0].parameters())
    all_reduce = torch.distributed.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls["gradient"] += tensor.numel() == size  # the model's gradient, in one piece
        return all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        train(accelerator, run, weighted, lrs, stop=stop)
    finally:
        torch.distributed.all_reduce = all_reduce
    return {
        "theta": flat(run[0]).tolist(),
        "all_reduces": calls,
        "lrs": lrs,
        "updates": run[1].updates,
        "sizes": [len(y) for _, y, _ in run[3]],
        "accelerator": accelerator,
        "run": run,
    }


def ddp_items(rank: int) -> dict[str, Any]:
    out = ddp_run(True, DDP_ROWS)
    return {k: v for k, v in out.items() if k not in ("accelerator", "run")}


def ddp_mean(rank: int) -> dict[str, Any]:
    out = ddp_run(False, 64)  # 16 micro-batches of 4: windows of 3, 3, 2 per rank
    return {k: v for k, v in out.items() if k not in ("accelerator", "run")}


def ddp_resume(rank: int) -> dict[str, Any]:
    """Save mid-window on both ranks, load into a new run, finish: equal to the whole run."""
    folder = os.environ["ACCUMOPT_TEST_CHECKPOINT"]
    whole = ddp_run(True, DDP_ROWS)
    first = ddp_run(True, DDP_ROWS, stop=DDP_STOP)
    position = (first["run"][1].micro_step, first["run"][1].updates)
    first["accelerator"].save_state(folder)
    first["accelerator"].wait_for_everyone()
    accelerator = ddp_accelerator()
    run = prepared(dataset(DDP_ROWS), accelerator, every=DDP_EVERY, micro=DDP_MICRO)
    accelerator.load_state(folder)
    train(accelerator, run, skip=DDP_STOP)
    accelerator.wait_for_everyone()
    os.remove(os.path.join(folder, f"accumopt_window_0_rank{rank}.pt"))
    accelerator = ddp_accelerator()
    prepared(dataset(DDP_ROWS), accelerator, every=DDP_EVERY, micro=DDP_MICRO)
    try:  # without its own window, a rank would load the main process's partial gradient
        accelerator.load_state(folder)
        refused = "not refused"
    except RuntimeError as err:
        refused = str(err)
    return {
        "position": position,
        "theta": flat(run[0]).tolist(),
        "whole": whole["theta"],
        "refused": refused,
    }


def ddp_without_helper(rank: int) -> list[str]:
    """The model prepared by plain accelerator.prepare: the wrapper cannot know the DDP module.
    Both orders are refused before anything is applied."""
    accelerator = ddp_accelerator()
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every=DDP_EVERY)
    model, _ = accelerator.prepare(model, opt)  # plain Accelerate: no set_model
    refusals = []
    try:
        opt.next_items(4)  # accumopt's core refuses items that would not be summed over ranks
    except ValueError as err:
        refusals.append(str(err))
    accelerator = ddp_accelerator()
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=LR), every=DDP_EVERY)
    optimizer = acc.prepare(accelerator, opt)
    model = accelerator.prepare(model)  # the model after, and not through the helper
    x, y, m = dataset(4)[:]
    accelerator.backward(loss_sum(model, x, y, m) / m.numel())
    try:
        optimizer.step()
    except RuntimeError as err:
        refusals.append(str(err))
    return refusals


DDP_SCENARIOS = {
    "items": ddp_items,
    "mean": ddp_mean,
    "resume": ddp_resume,
    "without_helper": ddp_without_helper,
}


@needs_accelerate
@pytest.mark.slow
def test_accelerate_ddp_two_ranks_exact_with_one_all_reduce_per_update_and_resume(
    clean_accelerate: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import scenarios_on_ranks

    monkeypatch.setenv("ACCUMOPT_TEST_CHECKPOINT", str(tmp_path))
    ranks = scenarios_on_ranks("test_integration_accelerate", "DDP_SCENARIOS")
    # the reference: one process, batches of a whole update (24 rows); the ranks' Accelerated-
    # Scheduler steps StepLR(gamma=0.5) twice per update (once per process), so gamma=0.25 here
    for name, rows, weighted in (("items", DDP_ROWS, True), ("mean", 64, False)):
        expected, expected_lrs = full_batch(dataset(rows), 24, gamma=0.25, weighted=weighted)
        for out in ranks:
            got = out[name]
            assert rel(torch.tensor(got["theta"]), expected) <= 1e-12, name
            assert got["lrs"] == expected_lrs and got["updates"] == 3
            # one gradient all-reduce per update: DDP synchronised the closing micro-step of
            # the 2 full windows (its 1 bucket each), accumopt summed the flushed window itself
            assert got["all_reduces"] == {"ddp": 2, "gradient": 3}, got
        assert ranks[0][name]["theta"] == ranks[1][name]["theta"]  # replicas bit-identical
    assert ranks[1]["items"]["sizes"][-1] == 1  # the ragged micro-batch ran on rank 1
    for out in ranks:
        assert out["resume"]["position"] == (1, 1)  # saved at micro-step 1 of window 2
        assert out["resume"]["theta"] == out["resume"]["whole"]  # bit for bit
        assert "middle of an accumulation window" in out["resume"]["refused"]
        items_refused, step_refused = out["without_helper"]
        assert "set_model" in items_refused and "never told the DDP model" in step_refused


# --- timm-style loops: a GradScaler wrapper that runs backward, step and update itself -------


class NativeScalerLike:
    """The call contract of timm's ``NativeScaler`` (``loss_scaler(loss, optimizer,
    clip_grad=None, parameters=None, need_update=True)``: scale + backward, then, when an
    update is due, optional ``unscale_`` + clip, ``scaler.step``, ``scaler.update``), and with
    ``unscale_always`` the BEiT/MAE ``NativeScalerWithGradNormCount``, which unscales on every
    update call to return the gradient norm. Written here so the test needs no timm."""

    def __init__(self, unscale_always: bool = False) -> None:
        self._scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        self.unscale_always = unscale_always

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        parameters: Any = None,
        need_update: bool = True,
    ) -> torch.Tensor | None:
        self._scaler.scale(loss).backward()
        norm = None
        if need_update:
            if clip_grad is not None or self.unscale_always:
                self._scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(parameters, clip_grad or float("inf"))
            self._scaler.step(optimizer)
            self._scaler.update()
        return norm


@pytest.mark.parametrize("gated", [False, True])
def test_timm_native_scaler_loop_with_accumulate_is_exact(gated: bool) -> None:
    """timm's loop with its own accumulation off (``--grad-accum-steps 1``: no ``loss /
    accum_steps``, ``need_update=True`` on every micro-batch), ``clip_grad=None`` (the wrapper
    clips the window once: ``max_grad_norm``), the LR schedule gated on ``opt.did_update``.
    gated: the BEiT/MAE loop, whose scaler wrapper unscales on every update call (for the norm
    it returns): it keeps ``update_grad=(i + 1) % accum_iter == 0``, drops ``loss /=
    accum_iter``. Either way the wrapper is given the scaler (``scaler=``). 63 rows: 3 windows
    of 4 x 5, then a ragged micro-batch of 3, flushed."""
    ds = dataset(63)
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    for x, y, m in torch.utils.data.DataLoader(ds, batch_size=EVERY * MICRO):
        (loss_sum(ref, x, y, m) / m.sum()).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()

    model = net()
    loss_scaler = NativeScalerLike(unscale_always=gated)
    opt = Accumulate(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        every=EVERY,
        max_grad_norm=0.05,  # the window's gradient, clipped once (the flushed one too)
        scaler=loss_scaler._scaler,  # each micro-step unscaled with its own scale
    )
    lr_scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for i, (x, y, m) in enumerate(torch.utils.data.DataLoader(ds, batch_size=MICRO)):
        need_update = (i + 1) % EVERY == 0 if gated else True
        opt.next_items(m.sum())  # the next backward pass (inside loss_scaler) covers these
        loss_scaler(
            loss_sum(model, x, y, m),
            opt,
            clip_grad=None,
            parameters=model.parameters(),
            need_update=need_update,
        )
        # did_update tells what the last opt.step() did: gated, only the updating calls step
        if need_update and opt.did_update:  # timm: step_update(num_updates=opt.updates)
            lr_scheduler.step()
        opt.zero_grad()
    if opt.flush():
        lr_scheduler.step()
    assert opt.updates == 4 and rel(flat(model), flat(ref)) <= 1e-12
    assert loss_scaler._scaler.get_scale() == 2.0 ** (8 + (3 if gated else 13))


@needs_accelerate
def test_accelerate_digits_example_first_window_is_exact(clean_accelerate: None) -> None:
    pytest.importorskip("sklearn", reason="the example needs scikit-learn's digits")
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "accelerate_digits.py")
    spec = importlib.util.spec_from_file_location("example_accelerate_digits", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as a user runs it
    try:
        AcceleratorState._reset_state(True)
        out = module.main(["--epochs", "2"])
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    assert out["first_window_rel"] <= 1e-12 and out["updates"] == 12
    assert out["test_accuracy"] > 0.5


@needs_accelerate
@pytest.mark.slow
def test_accelerate_digits_example_on_two_ddp_processes_is_exact_at_the_first_window() -> None:
    """``torchrun --nproc-per-node 2 examples/accelerate_digits.py``: DDP on gloo through the
    helper's prepare, the first window against one full-batch step (float64)."""
    pytest.importorskip("sklearn", reason="the example needs scikit-learn's digits")
    import re

    from helpers import torchrun_example

    out = torchrun_example("accelerate_digits.py", "--epochs", "1")
    number = r"(\d\.\d+e[+-]\d+)"
    rel = re.search(r"\(float64, 2 process\(es\)\).*relative to the update = " + number, out)
    assert rel is not None and float(rel.group(1)) <= 1e-12, out

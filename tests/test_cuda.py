"""accumopt on a real CUDA device: fp16 autocast with GradScaler, the bf16 window buffer, and the
auto micro-batch size recovering from real CUDA out-of-memory errors. Skipped without CUDA (the
CPU suite covers the same logic with simulated OOMs and CPU autocast)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import data, mlp, mse_sum
from torch import nn

from accumopt import Accumulate, MicroBatchRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().cpu().flatten() for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_cuda_fp16_autocast_gradscaler_windows_follow_the_full_batch() -> None:
    """fp32 parameters, fp16 autocast, the loss scale folded per micro-step: 3 windows of 4
    uneven micro-batches stay within fp16 rounding of the float64 full-batch trajectory, and no
    window is skipped at a safe initial scale."""
    ref = mlp(70, n_in=32, hidden=64, n_out=8)  # float64 on the CPU: the reference
    model = copy.deepcopy(ref).float().cuda()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.05), every=4, scaler=scaler)
    sizes = [5, 1, 7, 3]
    for w in range(3):
        x, y = data(70 + w, sum(sizes), n_in=32, n_out=8)
        ref_opt.zero_grad()
        (mse_sum(ref, x, y) / len(x)).backward()
        ref_opt.step()
        for xb, yb in zip(x.split(sizes), y.split(sizes)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss_sum = F.mse_loss(model(xb.float().cuda()), yb.float().cuda(), reduction="sum")
            acc.backward(scaler.scale(loss_sum), items=len(xb))
            scaler.step(acc)
            scaler.update()
            acc.zero_grad()
        assert acc.did_update, f"window {w} was skipped"
    got = torch.cat([p.detach().double().cpu().flatten() for p in model.parameters()])
    want = torch.cat([p.detach().flatten() for p in ref.parameters()])
    assert rel(got, want) < 5e-3


def test_cuda_bf16_buffer_window_is_as_exact_as_its_micro_batches() -> None:
    """bf16 parameters on the GPU, 128 micro-batches: the float32 buffer's window gradient is
    within 1.05x of the rounding floor (the float64 sum of the same bf16 micro-batch gradients,
    rounded once to bf16), and closer than plain bf16 ``.grad`` sums."""
    torch.manual_seed(0)
    k = 128
    base = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
    base = base.to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(k, 16, 64, generator=g).to("cuda", torch.bfloat16)
    ys = torch.randn(k, 16, 4, generator=g).to("cuda", torch.bfloat16)

    def loss(m: nn.Module, i: int) -> torch.Tensor:
        return F.mse_loss(m(xs[i]), ys[i])

    exact = torch.zeros_like(torch.cat([p.detach().flatten() for p in base.parameters()]).double())
    for i in range(k):  # the same bf16 micro-batch gradients, summed in float64
        grads = torch.autograd.grad(loss(base, i), list(base.parameters()))
        exact += torch.cat([gr.double().flatten() for gr in grads])
    exact = (exact / k).cpu()
    floor = rel(exact.bfloat16().double(), exact)

    errors = {}
    for buffer in (None, False):
        model = copy.deepcopy(base)
        acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.0), every=k, buffer=buffer)
        for i in range(k):
            loss(model, i).backward()
            if acc.will_update:
                errors[buffer] = rel(flat_grad(model), exact)
            acc.step()
            acc.zero_grad()
        del acc
    assert errors[None] <= 1.05 * floor + 1e-7, (errors, floor)
    assert errors[False] > errors[None], (errors, floor)


class Tall(nn.Module):
    """Little compute, large saved activations per row: ``depth`` tanh layers of ``width``."""

    def __init__(self, width: int = 2048, depth: int = 8) -> None:
        super().__init__()
        self.inp, self.out, self.depth = nn.Linear(16, width), nn.Linear(width, 1), depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.depth):
            h = torch.tanh(h)
        return self.out(h)  # type: ignore[no-any-return]


def test_cuda_auto_size_recovers_from_real_oom_and_keeps_every_sample() -> None:
    """A batch that needs about 2.5 GiB in float64 under a 0.5 GiB allocator cap: the runner hits
    real ``torch.OutOfMemoryError``s, shrinks, and its one update equals the float64 full-batch
    update on the CPU (every sample counted once)."""
    torch.manual_seed(0)
    ref = Tall()
    model = copy.deepcopy(ref).cuda()
    n = 16384
    x, y = torch.randn(n, 16), torch.randn(n, 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    (F.mse_loss(ref(x), y, reduction="sum") / n).backward()
    ref_opt.step()

    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=n)
    runner = MicroBatchRunner(
        acc,
        lambda b: F.mse_loss(model(b[0]), b[1], reduction="sum"),
        micro_batch_size="auto",
        device="cuda",
        loss_reduction="sum",
    )
    torch.cuda.empty_cache()
    cap = 0.5 * 2**30 / torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap)
    try:
        runner((x.pin_memory(), y.pin_memory()))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert runner.ooms >= 1 and runner.micro_batch_size is not None
    assert runner.micro_batch_size < n
    assert acc.updates == 1 and acc.micro_step == 0
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-9, atol=1e-12)


def test_cuda_runner_fixed_size_from_host_memory_equals_the_full_batch() -> None:
    """Host batch, fixed micro-batches moved one at a time (pinned, non_blocking): one update
    equal to the CPU float64 full-batch update."""
    ref = mlp(71, n_in=8, hidden=16, n_out=2)
    model = copy.deepcopy(ref).cuda()
    x, y = data(71, 37, n_in=8, n_out=2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_opt.zero_grad()
    (mse_sum(ref, x, y) / len(x)).backward()
    ref_opt.step()
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every_items=len(x))
    runner = MicroBatchRunner(
        acc,
        lambda b: mse_sum(model, b[0], b[1]),
        micro_batch_size=5,
        device="cuda",
        loss_reduction="sum",
    )
    runner((x.pin_memory(), y.pin_memory()))
    assert acc.updates == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-9, atol=1e-12)

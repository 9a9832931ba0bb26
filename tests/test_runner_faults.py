"""MicroBatchRunner under bad input and failed attempts: a refused micro-batch is counted
nowhere, and a micro-batch retried after running out of memory leaves no trace in the module
state (buffers, RNG) either."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, Literal

import pytest
import torch
from helpers import mlp
from torch import Tensor, nn

from accumopt import Accumulate, MicroBatchRunner
from accumopt.autosize import MicroBatchSizer
from accumopt.testing import simulate_oom

# micro-batches of a few rows through BatchNorm are the point here, not a mistake
pytestmark = pytest.mark.filterwarnings("ignore:accumopt. micro-batches of:UserWarning")

# ---------------------------------------------------------------- bad loss_fn results


def _bad(kind: str, loss: Tensor, rows: int) -> Any:
    """What a buggy loss_fn returns instead of ``(loss, rows)``."""
    return {
        "items_str": (loss, str(rows)),
        "items_vector": (loss, torch.tensor([1, 2])),
        "items_none": (loss, None),
        "items_negative": (loss, -1),
        "items_nan": (loss, math.nan),
        "items_inf_tensor": (loss, torch.tensor(math.inf)),
        "loss_vector": (loss.reshape(1).expand(2), rows),
        "loss_float": (loss.item(), rows),
        "loss_no_grad": (loss.detach(), rows),
        "not_a_tuple": [loss, rows],
    }[kind]


REFUSALS = {
    "items_str": (ValueError, r"loss_fn returned items='2', which is not a finite number >= 0"),
    "items_vector": (
        ValueError,
        r"items=tensor\(\[1, 2\]\), which is a tensor of shape \(2,\).*expected a single real",
    ),
    "items_none": (ValueError, r"items=None, which is not a finite number >= 0"),
    "items_negative": (ValueError, r"items=-1, which is not a finite number >= 0"),
    "items_nan": (ValueError, r"items=nan, which is not a finite number"),
    "items_inf_tensor": (ValueError, r"items=inf \(read from tensor\(inf\)\), which is not"),
    "loss_vector": (ValueError, r"loss=tensor\(\[.*\), a tensor of shape \(2,\); expected a one"),
    "loss_float": (TypeError, r"loss=[0-9.e+-]+, a float; expected a one-element tensor"),
    "loss_no_grad": (ValueError, r"a tensor that does not require grad"),
    "not_a_tuple": (TypeError, r"loss_fn returned a list; expected a loss tensor"),
}


class Tracked(nn.Module):
    """Updates buffers of its own in forward: one in place, one by reassignment."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.seen: Tensor
        self.ema: Tensor
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.seen.add_(x.shape[0])
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)
        return x


def bn_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), Tracked(8), nn.Dropout(0.3), nn.Linear(8, 3)
    )


def state_of(model: nn.Module) -> dict[str, Tensor]:
    """Parameters, buffers and the CPU generator's state, as copies."""
    found = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {**found, "cpu_rng": torch.get_rng_state()}


def assert_same_state(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    different = [k for k in got if not torch.equal(got[k], expected[k])]
    assert different == [], different


@pytest.mark.parametrize("mode", ["fixed", "auto"])
@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_bad_loss_fn_result_is_refused_before_anything_is_counted(mode: str, kind: str) -> None:
    """The second micro-batch's result is bad: refused with a clear error before its backward
    pass, so the wrapper's counts and the gradients are those of the first micro-batch alone
    (and with "auto", the model's buffers and the RNG are those after the first one too)."""
    model = bn_net(1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=100)
    calls: list[int] = []

    def loss_fn(b: tuple[Tensor, Tensor]) -> Any:
        calls.append(len(b[0]))
        loss = ((model(b[0]) - b[1]) ** 2).sum()
        return (loss, len(b[0])) if len(calls) == 1 else _bad(kind, loss, len(b[0]))

    size: int | Literal["auto"] = 2 if mode == "fixed" else "auto"
    runner = MicroBatchRunner(
        acc, loss_fn, micro_batch_size=size, start_size=2, model=model, loss_reduction="sum"
    )
    after_first: dict[str, Tensor] = {}

    def remember(*_: object) -> None:  # after the first micro-batch's step
        if not after_first:
            after_first.update(state_of(model))
            after_first.update(_grads(model))

    acc.register_step_post_hook(remember)
    exc, pattern = REFUSALS[kind]
    with pytest.raises(exc, match=r"^MicroBatchRunner: ") as info:
        runner((torch.randn(4, 4), torch.randn(4, 3)))
    assert info.match(pattern)
    assert info.match(r"this one and the rest of the batch were not\.$")
    assert calls == [2, 2] and acc.micro_step == 1 and acc.items == 2
    now = {**state_of(model), **_grads(model)}
    if mode == "fixed":  # no snapshot: the forward pass's buffer and RNG updates stay
        kept = {f"{n}{end}" for n, _ in model.named_parameters() for end in ("", ".grad")}
        now = {k: v for k, v in now.items() if k in kept}
        after_first = {k: v for k, v in after_first.items() if k in kept}
    assert_same_state(now, after_first)


def _grads(model: nn.Module) -> dict[str, Tensor]:
    """Copies of the gradients in ``.grad`` (None ones left out)."""
    return {f"{n}.grad": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- bad search settings


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"start_size": 0}, r"start_size=0 is not an int >= 1; expected the first"),
        ({"start_size": -1}, r"start_size=-1 is not an int >= 1"),
        ({"start_size": 2.5}, r"start_size=2.5 is not an int >= 1"),
        ({"start_size": True}, r"start_size=True is not an int >= 1"),
        ({"max_size": 0}, r"max_size=0 is not an int >= 1 or None; expected the largest"),
        ({"start_size": 8, "max_size": 4}, r"max_size=4 is smaller than start_size=8"),
        ({"grow_after": 0}, r"grow_after=0 is not an int >= 1 or None; expected the clean"),
        ({"grow_after": -5}, r"grow_after=-5 is not an int >= 1 or None"),
        ({"grow_after": 2.5}, r"grow_after=2.5 is not an int >= 1 or None"),
        ({"tolerance": -0.1}, r"tolerance=-0.1 is not a number in \[0, 1\); expected"),
        ({"tolerance": 1}, r"tolerance=1 is not a number in \[0, 1\)"),
        ({"tolerance": math.nan}, r"tolerance=nan is not a number in \[0, 1\)"),
        ({"tolerance": "0.1"}, r"tolerance='0.1' is not a number in \[0, 1\)"),
    ],
)
def test_bad_search_settings_are_refused_at_construction(
    kwargs: dict[str, Any], pattern: str
) -> None:
    acc = Accumulate(torch.optim.SGD(mlp(80).parameters(), lr=0.1), every_items=8)
    with pytest.raises(ValueError, match=rf"^MicroBatchRunner: {pattern}.*\. .*\.$"):
        MicroBatchRunner(acc, lambda b: b.sum(), **{"loss_reduction": "sum", **kwargs})
    assert acc.micro_step == 0 and acc.items == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"start": None}, r"start=None is not an int >= 1"),
        ({"start": 4, "grow_after": 0}, r"grow_after=0"),
        ({"start": 4, "max_size": 2}, r"max_size=2 is smaller than start=4"),
    ],
)
def test_bad_search_settings_are_refused_by_the_sizer_too(
    kwargs: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ValueError, match=rf"^MicroBatchSizer: {pattern}"):
        MicroBatchSizer(**kwargs)


# ---------------------------------------------------------------- module state after an OOM


def train(
    model: nn.Module,
    acc: Accumulate,
    batches: list[tuple[Tensor, Tensor]],
    run: Callable[[Callable[[Any], Tensor], tuple[Tensor, Tensor]], None],
) -> dict[str, Tensor]:
    """Train on ``batches`` from CPU seed 7 with ``run(loss_fn, batch)``; the final state."""

    def loss_fn(b: tuple[Tensor, Tensor]) -> Tensor:
        loss: Tensor = ((model(b[0]) - b[1]) ** 2).sum()
        return loss

    torch.manual_seed(7)
    for batch in batches:
        run(loss_fn, batch)
    rows = sum(len(x) for x, _ in batches)
    assert acc.updates == rows // acc.every_items and acc.micro_step == 0  # windows of batches
    return state_of(model)


def reference(
    model: nn.Module,
    batches: list[tuple[Tensor, Tensor]],
    sizes: list[int],
    every_items: int | None = None,
) -> Any:
    """The same training without any OOM: micro-batches of the given sizes, in order, in
    windows of ``every_items`` (default: one batch)."""
    every_items = every_items or len(batches[0][0])
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every_items=every_items)
    acc.enable_rollback()  # the runner's accumulation path, for bitwise equality
    todo = iter(sizes)

    def run(loss_fn: Callable[[Any], Tensor], batch: tuple[Tensor, Tensor]) -> None:
        offset = 0
        while offset < len(batch[0]):
            size = next(todo)
            piece = tuple(t[offset : offset + size] for t in batch)
            acc.backward(loss_fn(piece), items=size)
            acc.step()
            acc.zero_grad()
            offset += size

    return train(model, acc, batches, run)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("via", ["runner", "wrapper", "set_model"])
def test_failed_micro_batch_attempt_leaves_no_trace_in_module_state(where: str, via: str) -> None:
    """BatchNorm + buffers updated in place and by reassignment + Dropout, out of memory above
    5 rows (in the forward pass after BatchNorm ran, or half-way through the backward pass):
    parameters, running statistics, num_batches_tracked, the other buffers and the CPU
    generator end exactly as in a run that used the successful sizes from the start. The
    model is the runner's, the wrapper's, or given to the wrapper after the runner was built
    (``set_model``, as frameworks do; its buffers were not restored until 2026-12-02)."""
    model = bn_net(2)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)) for _ in "ab"]
    acc = Accumulate(
        torch.optim.Adam(model.parameters(), lr=0.01),
        every_items=12,
        model=model if via == "wrapper" else None,
    )
    runner: MicroBatchRunner | None = None

    def run(loss_fn: Callable[[Any], Tensor], batch: tuple[Tensor, Tensor]) -> None:
        nonlocal runner
        if runner is None:
            runner = MicroBatchRunner(
                acc, loss_fn, model=model if via == "runner" else None, loss_reduction="sum"
            )
            if via == "set_model":
                acc.set_model(model)
        runner(batch)

    watched = model[-1] if where == "forward" else model  # forward: after BatchNorm ran
    with simulate_oom(watched, 5, where=where, at=model[1]) as sim:  # type: ignore[arg-type]
        got = train(model, acc, batches, run)
    assert runner is not None and runner.ooms == len(sim.raised) >= 2
    sizes = [s for s in sim.sizes if s <= 5]
    assert sum(sizes) == 24
    assert_same_state(got, reference(twin, batches, sizes))


def test_without_a_model_the_generators_are_still_restored() -> None:
    """The documented limit: no model= anywhere, so the failed attempt's BatchNorm update
    stays; the random numbers it drew are given back all the same."""
    model = bn_net(4)
    twin = copy.deepcopy(model)
    batches = [(torch.randn(8, 4), torch.randn(8, 3))]
    acc = Accumulate(torch.optim.Adam(model.parameters(), lr=0.01), every_items=8)

    def run(loss_fn: Callable[[Any], Tensor], batch: tuple[Tensor, Tensor]) -> None:
        MicroBatchRunner(acc, loss_fn, loss_reduction="sum")(batch)

    with simulate_oom(model[-1], 4) as sim:
        got = train(model, acc, batches, run)
    expected = reference(twin, batches, [s for s in sim.sizes if s <= 4])
    assert torch.equal(got["cpu_rng"], expected["cpu_rng"])
    assert got["1.num_batches_tracked"] == expected["1.num_batches_tracked"] + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_failed_attempt_gives_back_the_cuda_generator() -> None:
    """Dropout on a CUDA device draws from that device's generator: a failed attempt's draws
    are given back there too (and BatchNorm's statistics on the device restored)."""
    model = bn_net(5).cuda()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    runner = MicroBatchRunner(
        acc,
        lambda b: ((model(b[0]) - b[1]) ** 2).sum(),
        device="cuda",
        model=model,
        loss_reduction="sum",
    )
    twin = copy.deepcopy(model)
    torch.cuda.manual_seed(11)
    with simulate_oom(model[-1], 4):
        runner((x, y))
    after = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(11)
    for piece in (slice(0, 4), slice(4, 8)):  # the sizes the runner settled on
        twin(x[piece].cuda())
    assert torch.equal(after, torch.cuda.get_rng_state())
    assert torch.equal(model.state_dict()["1.running_mean"], twin.state_dict()["1.running_mean"])

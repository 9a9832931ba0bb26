"""The micro-batch runner and the OOM-surviving size search, tested with simulated OOM."""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import OPTIMIZERS, assert_same_params, data, full_batch_step, mlp, twins
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accumopt import Accumulate, MicroBatchRunner, NoMicroBatchFits, Phase, is_oom
from accumopt.autosize import MicroBatchSizer
from accumopt.testing import simulate_oom


class Counter(nn.Module):
    """A model whose gradient tells which samples contributed, and how often.

    Sample i is a one-hot row; ``w[i]`` is its weight and ``a`` a shared scale, both 1. For the
    summed loss, ``w.grad[i]`` counts sample i's appearances and ``a.grad`` counts all of them.
    An OOM injected at ``self.w``'s output during backward strikes after ``a.grad`` was written.
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Linear(n, 1, bias=False)
        nn.init.ones_(self.w.weight)
        self.a = nn.Parameter(torch.ones(()))

    def forward(self, onehot: torch.Tensor) -> torch.Tensor:
        return self.a * self.w(onehot).squeeze(1)


def capture_update_grads(acc: Accumulate) -> list[list[torch.Tensor]]:
    """The gradients the inner optimizer steps on, one list per update."""
    seen: list[list[torch.Tensor]] = []
    acc.optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
    )
    return seen


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 48),
    limit=st.integers(1, 48),
    where=st.sampled_from(["forward", "backward"]),
    kind=st.sampled_from(["cuda", "cpu"]),
    start=st.one_of(st.none(), st.integers(1, 64)),
)
def test_every_sample_counted_exactly_once_under_oom(
    n: int, limit: int, where: str, kind: str, start: int | None
) -> None:
    model = Counter(n)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.0), every_items=n, reduction="sum")
    grads = capture_update_grads(acc)
    runner = MicroBatchRunner(acc, lambda x: model(x).sum(), start_size=start, loss_reduction="sum")
    with simulate_oom(model, limit, where=where, at=model.w, kind=kind) as sim:  # type: ignore[arg-type]
        mean = runner(torch.eye(n))
    assert len(grads) == 1 and acc.updates == 1
    a_grad, w_grad = grads[0]  # own parameters first, then the submodule's
    assert torch.equal(w_grad, torch.ones(1, n))  # each sample exactly once
    assert a_grad.item() == n  # no partial gradient of a failed micro-batch survived
    assert mean.item() == 1.0
    assert runner.ooms == len(sim.raised)
    assert max(s for s in sim.sizes if s not in sim.raised) <= limit


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    n=st.integers(1, 40),
    limit=st.integers(1, 40),
    where=st.sampled_from(["forward", "backward"]),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    windows=st.integers(1, 3),
)
def test_auto_sized_windows_equal_full_batch(
    seed: int, n: int, limit: int, where: str, opt_name: str, windows: int
) -> None:
    ref, model = twins(mlp(seed))
    ref_opt = OPTIMIZERS[opt_name](list(ref.parameters()))
    acc = Accumulate(OPTIMIZERS[opt_name](list(model.parameters())), every_items=n)

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((model(batch["x"]) - batch["y"]) ** 2).sum()

    runner = MicroBatchRunner(acc, loss_fn, loss_reduction="sum")
    with simulate_oom(model, limit, where=where, at=model[0]):
        for w in range(windows):
            x, y = data(seed + w, n)
            full_batch_step(ref, ref_opt, x, y)
            runner({"x": x, "y": y, "note": "passed through"})
            assert acc.updates == w + 1
            assert_same_params(model, ref)


def test_runner_mean_loss_outputs_and_item_counts() -> None:
    """loss_fn may report items (e.g. tokens) and per-row outputs; weights follow the items."""
    ref, model = twins(mlp(70))
    x, y = data(70, 10)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_loss = ((ref(x) - y) ** 2).sum(1)[mask].sum() / mask.sum()
    ref_loss.backward()
    ref_opt.step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=3)

    def loss_fn(b: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple:
        xb, yb, mb = b
        out = model(xb)
        return ((out - yb) ** 2).sum(1)[mb].sum(), mb.sum(), out.detach()

    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size=4, loss_reduction="sum")
    mean, outputs = runner((x, y, mask), return_outputs=True)
    assert acc.updates == 1 and runner.micro_batch_size == 4 and runner.ooms == 0
    torch.testing.assert_close(mean, ref_loss.detach())
    assert outputs.shape == (10, 3)
    assert_same_params(model, ref)


@pytest.mark.parametrize("micro", [3, "auto"])
def test_a_mean_loss_trains_exactly_by_default(micro: int | str) -> None:
    """torch's convention: loss_fn returns F.mse_loss's mean, and the default loss_reduction
    weights each micro-batch (3 + 3 + 1 rows, or what "auto" finds under a 3-row limit) by
    its rows: the update and the returned loss are the full batch's."""
    ref, model = (m.double() for m in twins(mlp(71)))
    x, y = (t.double() for t in data(71, 7))
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=7)
    runner = MicroBatchRunner(
        acc,
        lambda b: F.mse_loss(model(b[0]), b[1]),
        micro_batch_size=micro,  # type: ignore[arg-type]
        loss_reduction="mean",
    )
    with simulate_oom(model, 3):
        mean = runner((x, y))
    assert acc.updates == 1 and runner.micro_batch_size == 3
    torch.testing.assert_close(mean, ref_loss.detach(), rtol=1e-12, atol=0)
    assert_same_params(model, ref)


def test_a_mean_over_tokens_trains_exactly_by_default() -> None:
    """loss_fn returns cross_entropy's mean over the labels other than -100 and their count;
    a micro-batch with none of them (a NaN mean) adds nothing: the update is the full-batch
    step on the mean over every counted label."""
    ref, model = (m.double() for m in twins(mlp(72)))
    x = data(72, 8)[0].double()
    labels = torch.tensor([0, 2, -100, 1, -100, -100, 2, -100])  # micro-batch 3: no label
    F.cross_entropy(ref(x), labels).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)

    def loss_fn(b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return F.cross_entropy(model(b[0]), b[1]), (b[1] != -100).sum()

    MicroBatchRunner(acc, loss_fn, micro_batch_size=2, loss_reduction="mean")((x, labels))
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_runner_with_grad_scaler_under_oom() -> None:
    ref, model = twins(mlp(72))
    x, y = data(72, 12)
    full_batch_step(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), x, y)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    acc = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.01), every_items=12, scaler=sc)
    runner = MicroBatchRunner(
        acc, lambda b: ((model(b[0]) - b[1]) ** 2).sum(), loss_reduction="sum"
    )
    with simulate_oom(model, 5, where="backward", at=model[0]):
        runner((x, y))
    assert acc.updates == 1 and runner.ooms > 0
    assert_same_params(model, ref)


def test_size_search_reaches_the_limit_with_few_failures() -> None:
    """The auto-size targets, on the pure search: >= 0.95 L within 15 failed attempts."""
    for limit in (37, 100, 1000, 3000):
        sizer = MicroBatchSizer(4096)
        found = 0
        for _ in range(60):  # enough micro-batches to settle
            size = sizer.propose("shape", 4096)
            if size > limit:
                sizer.failed("shape", size)
            else:
                sizer.succeeded("shape", size)
                found = size
        assert found >= 0.95 * limit, (limit, found)
        assert sizer.ooms <= 15, (limit, sizer.ooms)


def test_size_search_sequence_is_binary_not_halving() -> None:
    sizer = MicroBatchSizer(64, tolerance=0.0)
    tried = []
    for _ in range(12):
        size = sizer.propose("k", 64)
        tried.append(size)
        (sizer.failed if size > 37 else sizer.succeeded)("k", size)
    assert tried[:9] == [64, 32, 48, 40, 36, 38, 37, 37, 37]
    assert sizer.ooms == 4


def test_ceiling_per_input_shape_and_growth_after_clean_steps() -> None:
    sizer = MicroBatchSizer(32, grow_after=3)
    limits = {"short": 32, "long": 8}

    def attempt(key: str) -> int:
        size = sizer.propose(key, 32)
        (sizer.failed if size > limits[key] else sizer.succeeded)(key, size)
        return size

    assert attempt("short") == 32
    assert [attempt("long") for _ in range(6)] == [32, 16, 8, 12, 10, 9]  # halve, then bisect
    ooms = sizer.ooms
    assert attempt("long") == 8 and attempt("short") == 32  # each shape keeps its ceiling
    assert attempt("long") == 8
    assert sizer.ooms == ooms
    limits["long"] = 12  # memory freed up: after 3 clean steps the search probes upwards
    sizes = [attempt("long") for _ in range(12)]
    assert sizes[-1] == 12


def test_micro_batch_of_one_that_does_not_fit_is_a_clear_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = mlp(73)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=4)
    runner = MicroBatchRunner(
        acc, lambda b: ((model(b[0]) - b[1]) ** 2).sum(), loss_reduction="sum"
    )
    x, y = data(73, 4)
    with (
        caplog.at_level(logging.INFO, logger="accumopt"),
        simulate_oom(model, 0),
        pytest.raises(NoMicroBatchFits, match=r"micro-batch of 1 sample.*Memory: cpu.*simulated"),
    ):
        runner((x, y))
    assert runner.history == [
        (runner.history[0][0], s, r) for s, r in [(4, "first"), (2, "smaller"), (1, "smaller")]
    ]
    assert "out of memory at micro-batch size 4" in caplog.text
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())


def test_errors_that_are_not_oom_propagate_unchanged() -> None:
    model = mlp(74)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=4)
    runner = MicroBatchRunner(acc, lambda b: model(b).sum(), loss_reduction="sum")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        runner(torch.zeros(4, 5))
    assert runner.ooms == 0


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (torch.OutOfMemoryError("anything at all"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_is_oom(error: BaseException, expected: bool) -> None:
    assert is_oom(error) is expected


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"micro_batch_size": 0}, ValueError, r"micro_batch_size=0"),
        ({"micro_batch_size": "big"}, ValueError, r"expected an int >= 1 or 'auto'"),
        ({"loss_reduction": "avg"}, ValueError, r"loss_reduction='avg'"),
    ],
)
def test_runner_bad_arguments(kwargs: dict, exc: type[Exception], pattern: str) -> None:
    acc = Accumulate(torch.optim.SGD(mlp(75).parameters(), lr=0.1), every_items=4)
    with pytest.raises(exc, match=pattern):
        MicroBatchRunner(acc, lambda b: b.sum(), **{"loss_reduction": "sum", **kwargs})


def test_runner_loss_reduction_is_required() -> None:
    """0.1's default was "sum" and the torch convention is "mean": a default either way would
    scale every update of someone's loop by its items without an error."""
    acc = Accumulate(torch.optim.SGD(mlp(75).parameters(), lr=0.1), every_items=4)
    with pytest.raises(TypeError, match=r"loss_reduction is required; expected 'mean'"):
        MicroBatchRunner(acc, lambda b: b.sum())


def test_runner_needs_the_wrapper() -> None:
    with pytest.raises(TypeError, match=r"expected an accumopt.Accumulate wrapper"):
        MicroBatchRunner(
            torch.optim.SGD(mlp(76).parameters()), lambda b: b.sum(), loss_reduction="sum"
        )  # type: ignore[arg-type]


def test_runner_rejects_mismatched_batch_without_losing_the_window() -> None:
    model = mlp(77)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    runner = MicroBatchRunner(
        acc, lambda b: ((model(b[0]) - b[1]) ** 2).sum(), micro_batch_size=2, loss_reduction="sum"
    )
    x, y = data(77, 4)
    runner((x, y))
    with pytest.raises(
        ValueError, match=r"batch\[1\] has 3 rows along dim 0 .* but batch\[0\] has 4"
    ):
        runner((x, y[:3]))
    assert acc.micro_step == 2 and acc.items == 4


def test_short_remainder_of_a_batch_is_not_a_size_change() -> None:
    """The last micro-batch of a batch takes the rows left: no history entry, no log line,
    and micro_batch_size keeps reporting where the search stands."""
    model = nn.Linear(2, 1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=10)
    runner = MicroBatchRunner(acc, lambda b: model(b).sum(), loss_reduction="sum")
    with simulate_oom(model, 4):
        for _ in range(3):
            runner(torch.randn(10, 2))  # settles at 4: 4 + 4 + 2 rows per call
    assert runner.micro_batch_size == 4 and runner.ooms == 2
    assert [size for _, size, _ in runner.history] == [10, 5, 2, 3, 4]


def test_search_does_not_grow_past_the_batch_without_failures() -> None:
    model = nn.Linear(2, 1)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8)
    runner = MicroBatchRunner(acc, lambda b: model(b).sum(), start_size=2, loss_reduction="sum")
    for _ in range(4):
        runner(torch.randn(8, 2))
    assert runner.micro_batch_size == 8 and runner.ooms == 0
    assert [size for _, size, _ in runner.history] == [2, 4, 8]


def stepped_copy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """A copy of ``model`` after one plain SGD step (lr 0.1) on the mean loss of ``x``."""
    ref = copy.deepcopy(model)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    return ref


@pytest.mark.parametrize("where", ["hidden", "loss"])
@pytest.mark.parametrize("count_at", ["outputs", "parameters"])
def test_a_backward_pass_dying_in_the_runner_pauses_counting_until_discard(
    count_at: str, where: str
) -> None:
    """A micro-batch whose backward pass dies part-way (at the hidden layer: after the last
    layer's gradient was accumulated) is not counted, and the wrapper refuses to go on until
    ``discard()``; one that dies before any gradient was written (at the loss) left nothing
    to refuse. Then it trains exactly."""
    model = mlp(82).double()
    x, y = data(82, 8)
    x, y = x.double(), y.double()
    given = model if count_at == "outputs" else None
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=given)
    calls = [0]

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in the backward pass")

    def arm(_: nn.Module, __: object, hidden: torch.Tensor) -> None:
        if calls[0] == 2 and where == "hidden":  # after model[2]'s gradient is accumulated
            hidden.register_hook(boom)

    armed = model[0].register_forward_hook(arm)
    first: list[torch.Tensor] = []  # model[2]'s gradient after the first micro-batch

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        loss = ((model(batch[0]) - batch[1]) ** 2).sum()
        if calls[0] == 2:
            first.append(model[2].weight.grad.clone())
            if where == "loss":
                loss.register_hook(boom)
        return loss

    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size=4, loss_reduction="sum")
    with pytest.raises(RuntimeError, match="boom"):
        runner((x, y))
    written = not torch.equal(model[2].weight.grad, first[0])
    assert acc.micro_step == 1 and written == (where == "hidden")
    if written:
        with pytest.raises(RuntimeError, match="failed part-way"):
            runner((x, y))
        assert acc.micro_step == 1 and calls[0] == 2  # refused before its loss_fn
    else:
        assert acc.phase is Phase.OPEN  # .grad holds the first micro-batch alone
    armed.remove()
    acc.discard()
    ref = stepped_copy(model, x, y)
    runner((x, y))
    assert acc.updates == 1
    assert_same_params(model, ref, rtol=1e-12)


def test_a_paused_wrapper_is_not_taken_for_an_out_of_memory_error_by_the_auto_runner() -> None:
    """The wrapper's refusal after a backward pass that failed part-way propagates from the
    "auto" runner as it is: no fake OOM, no rollback of its own, no size change."""
    model = mlp(83)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=16)
    fail = [True]

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in the backward pass")

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden = model[0](batch[0])
        if fail[0]:
            hidden.register_hook(boom)
        return ((model[2](model[1](hidden)) - batch[1]) ** 2).sum()

    runner = MicroBatchRunner(acc, loss_fn, loss_reduction="sum")
    x, y = data(83, 16)
    with pytest.raises(RuntimeError, match="boom"):
        runner((x, y))
    fail[0] = False
    history = runner.history
    with pytest.raises(RuntimeError, match="failed part-way"):
        runner((x, y))
    assert runner.ooms == 0 and runner.history == history and acc.micro_step == 0


def test_runner_frees_each_micro_batch_graph_before_the_next() -> None:
    """The runner keeps each micro-batch's loss detached: what its graph holds (a custom
    Function's ctx, a tensor hook's closure) is freed before the next micro-batch runs."""
    alive: list[weakref.ref[torch.Tensor]] = []

    class Tagged(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.aux = torch.zeros(1000)
            alive.append(weakref.ref(ctx.aux))
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g

    model = torch.nn.Linear(4, 3).double()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=20)
    seen: list[int] = []

    def loss_fn(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append(sum(r() is not None for r in alive))
        return ((Tagged.apply(model(b[0])) - b[1]) ** 2).sum()

    runner = MicroBatchRunner(opt, loss_fn, micro_batch_size=5, model=model, loss_reduction="sum")
    mean = runner(
        (torch.randn(20, 4, dtype=torch.float64), torch.randn(20, 3, dtype=torch.float64))
    )
    assert seen == [0, 0, 0, 0] and not mean.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device": "foo"}, ValueError, r"MicroBatchRunner: device='foo' is not a device"),
        ({"device": True}, TypeError, r"MicroBatchRunner: device=True is a bool"),
        ({"device": "cuda:0"}, ValueError, r"device='cuda:0' is a CUDA device but CUDA is not"),
        ({"loss_fn": None}, TypeError, r"MicroBatchRunner: loss_fn=None is not callable"),
        ({"model": "x"}, TypeError, r"MicroBatchRunner: model is a str"),
    ],
)
def test_runner_arguments_get_accumopts_errors(kwargs: dict, error: type, match: str) -> None:
    """Bad arguments reached the user as torch's errors at call time (or never: a device
    string torch cannot parse, an absent CUDA device, a loss_fn that is None)."""
    if "cuda" in str(kwargs.get("device")) and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model = nn.Linear(3, 1)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=4)
    args = {"loss_fn": lambda b: model(b).pow(2).mean(), "loss_reduction": "mean", **kwargs}
    loss_fn = args.pop("loss_fn")
    with pytest.raises(error, match=match):
        MicroBatchRunner(opt, loss_fn, micro_batch_size=2, **args)


def test_runner_return_outputs_must_be_a_bool() -> None:
    model = nn.Linear(3, 1)
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=4)
    runner = MicroBatchRunner(
        opt, lambda b: model(b).pow(2).mean(), micro_batch_size=2, loss_reduction="mean"
    )
    with pytest.raises(TypeError, match=r"return_outputs='no' is a str; expected True or False"):
        runner(torch.randn(4, 3), return_outputs="no")  # type: ignore[arg-type]
    assert opt.micro_step == 0 and all(p.grad is None for p in model.parameters())

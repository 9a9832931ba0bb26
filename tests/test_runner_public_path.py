"""The runner drives the wrapper through its public API only (``opt.backward``, ``step()``,
``zero_grad()``): it refuses what a plain loop is refused, before any gradient, makes every
``step()`` call someone else observes (step hooks, a subclass, an LR scheduler's wrapper), and
trains exactly when the model is compiled. Every case trains against a float64 reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same_params, data, mlp
from test_runner import stepped_copy
from torch import nn

import accumopt.distributed
from accumopt import Accumulate, MicroBatchRunner, Phase

Batch = tuple[torch.Tensor, torch.Tensor]


def fresh(seed: int, n: int) -> tuple[nn.Module, Batch, nn.Module]:
    """A float64 MLP, a batch of ``n`` rows and the model after one plain SGD step on it."""
    model = mlp(seed).double()
    x, y = data(seed, n)
    x, y = x.double(), y.double()
    return model, (x, y), stepped_copy(model, x, y)


def setup(seed: int, n: int, given: bool = True) -> tuple[nn.Module, Accumulate, Batch, nn.Module]:
    """:func:`fresh`, with the model's wrapper over windows of ``n`` items (counting at its
    outputs, or at the parameters)."""
    model, (x, y), ref = fresh(seed, n)
    at = model if given else None
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=n, model=at)
    return model, acc, (x, y), ref


def summed(model: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Batch], torch.Tensor]:
    return lambda b: ((model(b[0]) - b[1]) ** 2).sum()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def unchanged(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))


def test_a_closed_window_and_a_waiting_count_are_refused_mid_window() -> None:
    model, acc, (x, y), _ = setup(95, 12)
    runner = MicroBatchRunner(acc, summed(model), micro_batch_size=4, loss_reduction="sum")
    runner((x[:4], y[:4]))
    acc.backward(((model(x[4:]) - y[4:]) ** 2).sum(), items=8)  # closes the window
    before = grads(model)
    with pytest.raises(RuntimeError, match="complete and waits for step"):
        runner((x[:4], y[:4]))
    assert acc.micro_step == 2 and acc.will_update and unchanged(model, before)
    acc.step()  # not paused: the closed window is applied as it was
    assert acc.updates == 1
    runner((x[:4], y[:4]))
    acc.next_items(4)
    before = grads(model)
    with pytest.raises(ValueError, match="still waiting"):
        runner((x[4:8], y[4:8]))
    assert acc.micro_step == 1 and unchanged(model, before)


def test_a_window_of_unweighted_micro_steps_is_refused_before_any_gradient() -> None:
    model, (x, y), _ = fresh(96, 8)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4, model=model)
    for a in (0, 2):  # two unweighted micro-steps: the lean path's condition is mid-window
        ((model(x[a : a + 2]) - y[a : a + 2]) ** 2).sum().backward()
        acc.step()
    before = grads(model)
    with pytest.raises(ValueError, match="weighted"):
        MicroBatchRunner(acc, summed(model), micro_batch_size=4, loss_reduction="sum")((x, y))
    assert acc.micro_step == 2 and unchanged(model, before) and acc.phase is Phase.OPEN


def test_a_pass_that_died_inside_loss_fn_is_refused_mid_window() -> None:
    """Counting at the parameters, ``loss_fn`` runs a pass of its own that dies part-way on
    the second micro-batch (counting pauses): the runner refuses that micro-batch's backward
    pass, as the wrapper refuses until ``discard()``; nothing is counted."""
    model, acc, (x, y), ref = setup(97, 8, given=False)
    calls = [0]

    def boom(_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    def loss_fn(b: Batch) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:  # dies after the last layer's gradient was accumulated
            hidden = model[0](b[0])
            hidden.register_hook(boom)
            with pytest.raises(RuntimeError, match="boom"):
                model[2](model[1](hidden)).sum().backward()
        return ((model(b[0]) - b[1]) ** 2).sum()

    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size=4, loss_reduction="sum")
    with pytest.raises(RuntimeError, match="failed part-way"):
        runner((x, y))
    assert acc.micro_step == 1 and acc.phase is Phase.PASS
    acc.discard()
    runner((x, y))
    assert acc.updates == 1
    assert_same_params(model, ref, rtol=1e-12)


def test_items_under_a_process_group_set_up_mid_window_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Items counted by one rank of several without a DDP/FSDP2 model are refused at every
    micro-step, also where the window's first micro-step saw no process group (one set up
    since, or a window restored from a checkpoint)."""
    model, acc, (x, y), _ = setup(98, 8)
    runner = MicroBatchRunner(acc, summed(model), micro_batch_size=4, loss_reduction="sum")
    runner((x[:4], y[:4]))
    dist = accumopt.distributed.dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *_: 2)
    before = grads(model)
    with pytest.raises(ValueError, match="2 ranks"):
        runner((x[4:], y[4:]))
    assert acc.micro_step == 1 and unchanged(model, before)


class Logged(Accumulate):
    """A wrapper whose subclass logs every ``step()`` and ``zero_grad()`` call."""

    log: list[str]

    def step(self, closure: Any = None) -> Any:
        self.log.append("step")
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append("zero_grad")
        super().zero_grad(set_to_none)


def test_every_step_call_someone_observes_is_made() -> None:
    """Step hooks, a subclass's ``step()`` and ``zero_grad()``, and an LR scheduler's wrapper
    of ``step`` each see one call per micro-batch, as from a plain loop."""
    model, acc, batch, ref = setup(99, 8)
    pre: list[int] = []
    acc.register_step_pre_hook(lambda *_: pre.append(acc.micro_step))
    MicroBatchRunner(acc, summed(model), micro_batch_size=2, loss_reduction="sum")(batch)
    assert pre == [1, 2, 3, 4] and acc.updates == 1 and acc.did_update
    assert_same_params(model, ref, rtol=1e-12)

    model, batch, ref = fresh(99, 8)
    logged = Logged(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=model)
    logged.log = []
    MicroBatchRunner(logged, summed(model), micro_batch_size=2, loss_reduction="sum")(batch)
    assert logged.log == ["step", "zero_grad"] * 4 and logged.updates == 1
    assert_same_params(model, ref, rtol=1e-12)

    model, acc, batch, ref = setup(99, 8)
    torch.optim.lr_scheduler.StepLR(acc, step_size=10)  # replaces acc.step on the instance
    calls: list[int] = []
    scheduled = acc.step

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(acc.micro_step)
        return scheduled(*args, **kwargs)

    acc.step = wrapped  # type: ignore[method-assign]
    MicroBatchRunner(acc, summed(model), micro_batch_size=2, loss_reduction="sum")(batch)
    assert calls == [1, 2, 3, 4] and acc.updates == 1
    assert_same_params(model, ref, rtol=1e-12)


@pytest.mark.parametrize("compiled", ["the model", "an outer module"])
def test_a_compiled_model_trains_exactly_by_runner_and_plain_loop_in_turn(compiled: str) -> None:
    """The compiled module given as ``model=`` (the README's setting; its counting hook runs
    outside the compiled code): runner calls and a plain loop counted by that hook, on
    micro-batches of one shape, in turn on one wrapper, each update equal to the float64
    full-batch one."""
    model, (x, y), _ = fresh(100, 8)
    ref = mlp(100).double()
    outer = model if compiled == "the model" else nn.Sequential(model, nn.Identity())
    module = torch.compile(outer, backend="eager")
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=8, model=module)
    runner = MicroBatchRunner(acc, summed(module), micro_batch_size=4, loss_reduction="sum")
    reference = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        if step % 2:
            for a in (0, 4):  # counted by the model's hook (opt.backward counts without it)
                acc.next_items(4)
                ((module(x[a : a + 4]) - y[a : a + 4]) ** 2).sum().backward()
                acc.step()
                acc.zero_grad()
        else:
            runner((x, y))
        reference.zero_grad()
        (((ref(x) - y) ** 2).sum() / 8).backward()
        reference.step()
        assert acc.updates == step + 1
        assert_same_params(model, ref, rtol=1e-12)


@pytest.mark.parametrize("micro", [8, 3])
def test_the_mean_loss_keeps_the_shape_of_the_losses(micro: int) -> None:
    model, acc, batch, _ = setup(101, 8)

    def loss_fn(b: Batch) -> torch.Tensor:
        return ((model(b[0]) - b[1]) ** 2).sum().reshape(1)

    expected = loss_fn(batch).detach() / 8
    mean = MicroBatchRunner(acc, loss_fn, micro_batch_size=micro, loss_reduction="sum")(batch)
    assert mean.shape == (1,)
    torch.testing.assert_close(mean, expected, rtol=1e-12, atol=0)


def test_a_removed_counter_is_not_hooked_again_by_the_runner() -> None:
    """A counter removed while ``loss_fn`` runs (``set_model`` rebinding the wrapper) does not
    get its old hook put back: the model ends with the new counter's hook alone."""
    model, acc, (x, y), _ = setup(97, 8)

    def loss_fn(b: Batch) -> torch.Tensor:
        if acc.model is model:
            acc.set_model(None)  # the old counter is removed, the wrapper counts at parameters
        return ((model(b[0]) - b[1]) ** 2).sum()

    runner = MicroBatchRunner(acc, loss_fn, micro_batch_size=8, loss_reduction="sum")
    runner((x, y))
    assert len(model._forward_hooks) == 0 and acc.updates == 1

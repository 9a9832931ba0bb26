"""The runner lifts the wrapper's counting forward hook off the model while ``loss_fn`` runs
(``accumopt._unhooked``), so that ``nn.Module.__call__`` takes its fast path: the hook must be
back, first in line, whatever happens, and stay where other hooks or compiled code need it;
and the runner's lean path into the wrapper (``_backward_here``, ``_step_inside_window``)
must refuse what the public path refuses. Every case trains against a float64 reference."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
import torch
from helpers import assert_same_params, data, mlp
from test_runner import stepped_copy
from torch import nn

from accumopt import Accumulate, MicroBatchRunner
from accumopt import _unhooked as unhooked_module

Batch = tuple[torch.Tensor, torch.Tensor]


def setup(seed: int, n: int) -> tuple[nn.Module, Accumulate, Batch, nn.Module]:
    """A float64 MLP, its wrapper counting at its outputs over windows of ``n`` items, a batch
    of ``n`` rows and the model after one plain SGD step on that batch (the reference)."""
    model = mlp(seed).double()
    x, y = data(seed, n)
    x, y = x.double(), y.double()
    ref = stepped_copy(model, x, y)
    acc = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=n, model=model)
    return model, acc, (x, y), ref


def summed(model: nn.Module, seen: list[list[int]]) -> Callable[[Batch], torch.Tensor]:
    """A ``loss_fn`` that records the keys of the model's forward hooks as it starts."""

    def loss_fn(batch: Batch) -> torch.Tensor:
        seen.append(list(model._forward_hooks))
        return ((model(batch[0]) - batch[1]) ** 2).sum()

    return loss_fn


def counted_by_the_hook(model: nn.Module, acc: Accumulate, batch: Batch) -> bool:
    """Whether a plain ``loss.backward()`` outside the runner is counted (the hook is back);
    the counted micro-step is dropped again."""
    before = acc.micro_step
    acc.next_items(len(batch[0]))
    ((model(batch[0]) - batch[1]) ** 2).sum().backward()
    counted = acc.micro_step == before + 1
    acc.discard()
    return counted


def test_the_counting_hook_is_lifted_while_loss_fn_runs_and_put_back_first() -> None:
    model, acc, batch, ref = setup(91, 8)
    ours = list(model._forward_hooks)
    seen: list[list[int]] = []
    calls: list[int] = []
    handles = []
    plain = summed(model, [])

    def loss_fn(b: Batch) -> torch.Tensor:
        seen.append(list(model._forward_hooks))
        if not handles:  # a hook the user registers while the runner runs stays
            handles.append(model.register_forward_hook(lambda *_: calls.append(1)))
        return plain(b)

    MicroBatchRunner(acc, loss_fn, micro_batch_size=3)(batch)
    assert seen[0] == [] and acc.updates == 1
    assert_same_params(model, ref, rtol=1e-12)
    assert list(model._forward_hooks) == [*ours, handles[0].id] and len(calls) == 3
    handles[0].remove()
    assert list(model._forward_hooks) == ours
    assert counted_by_the_hook(model, acc, batch)


@pytest.mark.parametrize("error", [ValueError("bad batch"), KeyboardInterrupt()])
def test_the_hook_goes_back_when_loss_fn_raises(error: BaseException) -> None:
    model, acc, batch, ref = setup(92, 8)
    ours = list(model._forward_hooks)

    def loss_fn(b: Batch) -> torch.Tensor:
        assert list(model._forward_hooks) == []
        raise error

    with pytest.raises(type(error)):
        MicroBatchRunner(acc, loss_fn, micro_batch_size=3)(batch)
    assert list(model._forward_hooks) == ours and acc.micro_step == 0
    assert counted_by_the_hook(model, acc, batch)
    MicroBatchRunner(acc, summed(model, []), micro_batch_size=5)(batch)
    assert_same_params(model, ref, rtol=1e-12)


@contextmanager
def global_forward_hook() -> Iterator[None]:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        yield
    finally:
        handle.remove()


KEEPERS: dict[str, Callable[[nn.Module], Any]] = {
    "another forward hook": lambda m: m.register_forward_hook(lambda *_: None),
    "a forward pre-hook": lambda m: m.register_forward_pre_hook(lambda *_: None),
    "a full backward hook": lambda m: m.register_full_backward_hook(lambda *_: None),
    "compiled in place": lambda m: m.compile(),
}


@pytest.mark.parametrize("keeper", [*KEEPERS, "a global forward hook"])
def test_the_hook_stays_where_other_hooks_or_compiled_code_need_it(keeper: str) -> None:
    """With another hook the call takes the slow path anyway; compiled code guards on the
    hooks: the counting hook stays in place (the runner still counts by itself, exactly)."""
    model, acc, batch, ref = setup(93, 8)
    if keeper in KEEPERS:
        KEEPERS[keeper](model)
    seen: list[list[int]] = []
    ours = list(model._forward_hooks)
    loss_fn = summed(model, seen)
    if keeper == "compiled in place":  # not run (no compiler here): its hooks are what counts

        def loss_fn(b: Batch) -> torch.Tensor:
            seen.append(list(model._forward_hooks))
            return sum((p.sum() * b[0].sum()) ** 2 for p in model.parameters())

    with global_forward_hook() if keeper == "a global forward hook" else _nothing():
        MicroBatchRunner(acc, loss_fn, micro_batch_size=3)(batch)
    assert seen[-1] == ours and acc.updates == 1 and list(model._forward_hooks) == ours
    if keeper != "compiled in place":
        assert_same_params(model, ref, rtol=1e-12)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def interrupted_at(line: int, run: Callable[[], None]) -> bool:
    """Run ``run`` with a KeyboardInterrupt raised at the ``line``-th line executed inside
    ``accumopt._unhooked``; whether it was raised."""
    hits = [0]
    path = unhooked_module.__file__

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code.co_filename != path:
            return None
        if event == "line":
            hits[0] += 1
            if hits[0] == line:
                raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer)
    try:
        run()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_an_interrupt_at_any_line_of_the_lift_loses_no_hook_and_no_count() -> None:
    """A KeyboardInterrupt at each line the lift runs (entering, leaving, restoring): the hook
    is back in place by the next runner call at the latest, and the run then trains exactly;
    meanwhile a plain backward pass is counted or refused, never silently left out."""
    line = 0
    while True:
        line += 1
        model, acc, batch, ref = setup(94, 8)
        ours = list(model._forward_hooks)
        runner = MicroBatchRunner(acc, summed(model, []), micro_batch_size=8)
        if not interrupted_at(line, lambda runner=runner, batch=batch: runner(batch)):
            break  # past the last line the lift runs
        assert acc.micro_step == 0 and acc.updates == 0
        if list(model._forward_hooks) != ours:  # interrupted before the hook went back
            ((model(batch[0]) - batch[1]) ** 2).sum().backward()
            with pytest.raises(RuntimeError, match="no backward pass since"):
                acc.step()
            model.zero_grad(set_to_none=True)
        runner(batch)
        assert list(model._forward_hooks) == ours and acc.updates == 1
        assert_same_params(model, ref, rtol=1e-12)
    assert line > 10


def test_the_lean_path_into_the_wrapper_refuses_what_the_public_path_refuses() -> None:
    """Mid-window (where the runner skips the full check): a count already waiting, a closed
    window not stepped, a window of unweighted micro-steps: each refused before its backward
    pass (no gradient added, the wrapper not paused), nothing counted."""
    model, acc, (x, y), _ = setup(95, 12)
    runner = MicroBatchRunner(acc, summed(model, []), micro_batch_size=4)
    runner((x[:4], y[:4]))
    acc.backward(((model(x[4:]) - y[4:]) ** 2).sum(), items=8)  # closes the window
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="window closed"):
        runner((x[:4], y[:4]))
    assert acc.micro_step == 2 and acc.will_update
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    acc.step()  # not paused: the closed window is applied as it was
    assert acc.updates == 1
    runner((x[:4], y[:4]))
    acc.next_items(4)
    with pytest.raises(ValueError, match="still waiting"):
        runner((x[4:8], y[4:8]))
    assert acc.micro_step == 1

    other = mlp(95).double()
    plain = Accumulate(torch.optim.SGD(other.parameters(), lr=0.1), every=4, model=other)
    ((other(x) - y) ** 2).sum().backward()
    plain.step()
    with pytest.raises(ValueError, match="weighted"):
        MicroBatchRunner(plain, summed(other, []), micro_batch_size=4)((x, y))
    assert plain.micro_step == 1


def test_the_runner_does_not_step_the_wrapper_inside_the_window_but_runs_step_hooks() -> None:
    """Inside the window the runner does what ``step()`` does there without calling it; a
    wrapper with step hooks gets every ``step()`` call, as from a plain loop."""
    model, acc, batch, ref = setup(96, 8)
    pre: list[int] = []
    acc.register_step_pre_hook(lambda *_: pre.append(acc.micro_step))
    MicroBatchRunner(acc, summed(model, []), micro_batch_size=2)(batch)
    assert pre == [1, 2, 3, 4] and acc.updates == 1 and acc.did_update
    assert_same_params(model, ref, rtol=1e-12)


def test_a_model_compiled_inside_a_larger_module_trains_exactly_by_runner_and_plain_loop() -> None:
    """The counted model runs inside a compiled outer module (Dynamo guards on its hooks):
    the runner's calls, with the hook lifted, and a plain loop's, with it in place, each get
    compiled code of their own, and every update equals the float64 full-batch one."""
    model, acc, (x, y), _ = setup(97, 8)
    ref = mlp(97).double()
    compiled = torch.compile(nn.Sequential(model, nn.Identity()), backend="eager")
    runner = MicroBatchRunner(
        acc, lambda b: ((compiled(b[0]) - b[1]) ** 2).sum(), micro_batch_size=3
    )
    reference = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        if step % 2:
            acc.backward(((compiled(x) - y) ** 2).sum(), items=8)
            acc.step()
            acc.zero_grad()
        else:
            runner((x, y))
        reference.zero_grad()
        (((ref(x) - y) ** 2).sum() / 8).backward()
        reference.step()
        assert acc.updates == step + 1
        assert_same_params(model, ref, rtol=1e-12)

"""Accumulate(..., model=m): backward passes counted at the model's outputs (float64).

The counting moves from one hook per parameter to one node pre-hook per model output; what
counts must not change: passes that accumulate into the wrapped parameters count once each,
``torch.autograd.grad`` and ``backward(inputs=...)`` without the parameters do not.
"""

from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
from helpers import assert_same_params, data, full_batch_step, mlp, mse_sum, twins
from torch import nn

from accumopt import Accumulate


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_no_parameter_hooks_and_the_same_update_as_counting_at_parameters() -> None:
    base = mlp(80)
    a, b = twins(base)
    at_params = Accumulate(sgd(a), every=3)
    at_outputs = Accumulate(sgd(b), every=3, model=b)
    assert all(not p._post_accumulate_grad_hooks for p in b.parameters())
    x, y = data(80, 9)
    for xb, yb in zip(x.split(3), y.split(3)):
        for model, opt in ((a, at_params), (b, at_outputs)):
            (mse_sum(model, xb, yb) / 3).backward()
            opt.step()
            opt.zero_grad()
    assert at_params.updates == at_outputs.updates == 1
    assert_same_params(a, b, rtol=0, atol=0)


def test_gradient_penalty_through_autograd_grad_counts_one_micro_step() -> None:
    """WGAN-GP style: autograd.grad through the model's outputs inside each micro-step."""
    ref, model = twins(mlp(81))
    x, y = data(81, 8)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = Accumulate(sgd(model), every=4, model=model)

    def loss(m: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        xb = xb.clone().requires_grad_(True)
        out = m(xb)
        (g,) = torch.autograd.grad(out.sum(), xb, create_graph=True)
        return ((out - yb) ** 2).sum() + g.pow(2).sum()

    ref_opt.zero_grad()
    (sum(loss(ref, xb, yb) for xb, yb in zip(x.split(2), y.split(2))) / 4).backward()
    ref_opt.step()
    for i, (xb, yb) in enumerate(zip(x.split(2), y.split(2))):
        loss(model, xb, yb).backward()
        assert acc.micro_step == i + 1
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_autograd_grad_of_the_parameters_is_not_counted() -> None:
    model = mlp(82)
    acc = Accumulate(sgd(model), every=2, model=model)
    x, y = data(82, 2)
    torch.autograd.grad(mse_sum(model, x, y), list(model.parameters()))
    assert acc.micro_step == 0
    with pytest.raises(RuntimeError, match="no backward pass since the last step"):
        acc.step()


def test_backward_into_the_inputs_only_is_not_counted() -> None:
    model = mlp(83)
    acc = Accumulate(sgd(model), every=2, model=model)
    x, y = data(83, 2)
    x.requires_grad_(True)
    mse_sum(model, x, y).backward(inputs=[x])
    assert acc.micro_step == 0 and x.grad is not None
    assert all(p.grad is None for p in model.parameters())


def test_a_penalty_outside_the_outputs_is_refused_unless_given_to_opt_backward() -> None:
    model = mlp(84)
    acc = Accumulate(sgd(model), every=2, model=model)
    penalty = sum(p.pow(2).sum() for p in model.parameters())
    penalty.backward()  # reaches the parameters, not the outputs: not counted
    with pytest.raises(RuntimeError, match=r"computed from the outputs of the .* given as model="):
        acc.step()
    acc.discard()
    penalty = sum(p.pow(2).sum() for p in model.parameters())
    acc.backward(penalty)  # always one micro-step
    assert acc.micro_step == 1


def test_two_forward_calls_in_one_pass_count_once_and_retain_graph_counts_each_pass() -> None:
    model = mlp(85)
    acc = Accumulate(sgd(model), every=3, model=model)
    x, y = data(85, 4)
    (mse_sum(model, x[:2], y[:2]) + mse_sum(model, x[2:], y[2:])).backward()
    assert acc.micro_step == 1
    acc.step()
    out = model(x)
    ((out - y) ** 2).sum().backward(retain_graph=True)
    assert acc.micro_step == 2
    acc.step()
    out.abs().sum().backward()
    assert acc.will_update and acc.micro_step == 3


class TwoHeads(nn.Module):
    """A trunk and two heads, returning a dict; a frozen first layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(86)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.trunk = nn.Linear(4, 5)
        self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.trunk(self.frozen(x)))
        return {"a": self.a(h), "b": self.b(h)}


@pytest.mark.parametrize("heads", [("a",), ("b",), ("a", "b")])
def test_dict_outputs_frozen_layers_and_unused_heads(heads: tuple[str, ...]) -> None:
    ref, model = twins(TwoHeads())
    acc = Accumulate(sgd(model), every=2, model=model)
    ref_opt = sgd(ref)
    x, y = data(86, 4)

    def loss(m: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = m(xb)
        return sum((((out[h] - yb) ** 2).sum() for h in heads), torch.zeros(()))

    ref_opt.zero_grad()
    (loss(ref, x, y) / 4).backward()
    ref_opt.step()
    for xb, yb in zip(x.split(2), y.split(2)):
        acc.backward(loss(model, xb, yb), items=2)
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_compiled_model_given_as_model() -> None:
    ref, model = twins(mlp(87))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ref_opt = sgd(ref)
    acc = Accumulate(sgd(model), every=2, model=compiled)
    x, y = data(87, 6)
    full_batch_step(ref, ref_opt, x, y)
    for xb, yb in zip(x.split(3), y.split(3)):
        (mse_sum(compiled, xb, yb) / 3).backward()
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    assert_same_params(model, ref)


def test_model_given_uncompiled_after_its_code_was_compiled_is_refused() -> None:
    """The module given as ``model=`` while a compiled one runs it, compiled before the wrapper
    hooked it: Dynamo does not guard on hooks, so its code runs without the counting hook. The
    pass is refused at ``step()``, before any update, and the refusal says to give the
    compiled module (given so, it trains exactly: test_compiled_model_given_as_model)."""
    model = mlp(86)
    compiled = torch.compile(model, backend="eager")
    x, y = data(86, 6)
    # traced while the module has no hook (e.g. a warm-up or evaluation), at the shape trained
    # on below: another shape would recompile it, with the hook, unless Dynamo already marked
    # the batch dimension dynamic for Sequential.forward (an earlier test in the process)
    compiled(x[:3])
    acc = Accumulate(sgd(model), every=2, model=model)
    (mse_sum(compiled, x[:3], y[:3]) / 3).backward()
    with pytest.raises(RuntimeError, match=r"the compiled module under torch\.compile"):
        acc.step()
    assert acc.updates == 0


def test_dropped_wrapper_removes_its_forward_hook() -> None:
    model = mlp(88)
    old = Accumulate(sgd(model), every=1, model=model)
    ref = weakref.ref(old)
    del old
    assert ref() is None and not model._forward_hooks


def test_deepcopy_and_pickle_keep_counting_at_the_outputs() -> None:
    model = mlp(89)
    acc = Accumulate(sgd(model), every=2, model=model)
    x, y = data(89, 2)
    mse_sum(model, x, y).backward()
    acc.step()
    for clone in (copy.deepcopy(acc), pickle.loads(pickle.dumps(acc))):
        assert clone.micro_step == 1 and clone.model is not model
        params = [p for g in clone.param_groups for p in g["params"]]
        assert {id(p) for p in clone.model.parameters()} == {id(p) for p in params}
        mse_sum(clone.model, x, y).backward()
        assert clone.will_update and acc.micro_step == 1  # the original did not count it
        assert len(clone.model._forward_hooks) == 2  # an inert copy and the clone's own


def test_model_of_the_wrong_type_is_a_type_error() -> None:
    model = mlp(90)
    with pytest.raises(TypeError, match=r"expected the torch\.nn\.Module"):
        Accumulate(sgd(model), every=2, model=model.parameters())  # type: ignore[arg-type]


def test_model_that_holds_none_of_the_parameters_is_refused() -> None:
    model = mlp(91)
    with pytest.raises(ValueError, match="holds none of the optimizer's parameters"):
        Accumulate(sgd(model), every=2, model=mlp(92))


class ViewOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(93)
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, :3]  # a view


@pytest.mark.parametrize("given", [False, True])
def test_a_returned_view_changed_in_place_is_counted(given: bool) -> None:
    ref, model = twins(ViewOut())
    acc = Accumulate(sgd(model), every=2, model=model if given else None)
    ref_opt = sgd(ref)
    x, y = data(93, 4)

    def loss(m: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = m(xb)
        out.div_(2.0)  # a temperature applied in place
        return ((out - yb) ** 2).sum()

    ref_opt.zero_grad()
    (loss(ref, x, y) / 4).backward()
    ref_opt.step()
    for xb, yb in zip(x.split(2), y.split(2)):
        (loss(model, xb, yb) / 2).backward()
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    assert_same_params(model, ref)


class ParamOut(nn.Module):
    """Returns a parameter as it is (a learned log-variance)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(94)
        self.lin, self.log_var = nn.Linear(4, 3), nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.log_var


def test_a_returned_parameter_is_hooked_once_and_released_with_the_wrapper() -> None:
    model = ParamOut()
    acc = Accumulate(sgd(model), every=2, model=model)
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(2, 4))
    for _ in range(5):
        model(torch.randn(2, 4))
    assert len(model.log_var._backward_hooks or {}) == 1
    _, log_var = model(torch.randn(2, 4))
    log_var.sum().backward()  # reaches only the returned parameter
    assert acc.micro_step == 1
    ref = weakref.ref(acc)
    del acc
    assert ref() is None and not model.log_var._backward_hooks and not model._forward_hooks


@pytest.mark.parametrize("change", ["dtype", "back and forth"])
def test_counting_survives_a_dtype_change_of_the_model(change: str) -> None:
    model = mlp(95)
    acc = Accumulate(sgd(model), every=2, model=model)
    model.float()
    if change == "back and forth":
        model.double()
    dtype = torch.float32 if change == "dtype" else torch.float64
    x, y = (t.to(dtype) for t in data(95, 2))
    for _ in range(2):
        mse_sum(model, x, y).backward()
        acc.step()
    assert acc.updates == 1


def test_reentrant_checkpointing_counts_the_outer_pass_once() -> None:
    """Counting at the parameters: the nested pass of the checkpointed block runs inside the
    outer pass, after the head's gradient, and counts as part of it."""
    torch.manual_seed(96)
    emb, block, head = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
    params = [*emb.parameters(), *block.parameters(), *head.parameters()]
    acc = Accumulate(torch.optim.SGD(params, lr=0.1), every=10)
    x, y = data(96, 2)
    out = head(torch.utils.checkpoint.checkpoint(block, emb(x), use_reentrant=True))
    ((out - y) ** 2).sum().backward()
    assert acc.micro_step == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script itself
def test_torchscript_model_is_a_clear_type_error() -> None:
    model = torch.jit.script(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="TorchScript"):
        Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2, model=model)


def test_hooks_of_the_users_own_on_the_outputs_still_run_once() -> None:
    model = mlp(97)
    seen: list[str] = []

    def users_forward_hook(_: nn.Module, __: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append("f"))

    # registered first: the output already has hooks when the wrapper's forward hook runs
    model.register_forward_hook(users_forward_hook)
    acc = Accumulate(sgd(model), every=3, model=model)
    x, y = data(97, 2)
    out = model(x)
    handle = out.register_hook(lambda g: seen.append("later"))  # after the wrapper's hook
    ((out - y) ** 2).sum().backward()
    assert seen == ["f", "later"] and acc.micro_step == 1
    acc.step()
    out = model(x)
    out.register_hook(lambda g: seen.append("removed")).remove()
    handle.remove()
    ((out - y) ** 2).sum().backward()
    assert seen == ["f", "later", "f"] and acc.micro_step == 2


def test_hooks_registered_on_outputs_after_the_wrapper_work() -> None:
    """The wrapper's own hook dict on an output must take the user's later hooks (torch's
    RemovableHandle keeps a weak reference to it) and their removal."""
    model = mlp(98)
    acc = Accumulate(sgd(model), every=3, model=model)
    x, y = data(98, 2)
    seen: list[str] = []
    out = model(x)
    handle = out.register_hook(lambda g: seen.append("tensor"))
    torch.autograd.graph.register_multi_grad_hook([out], lambda gs: seen.append("multi"))
    ((out - y) ** 2).sum().backward()
    assert sorted(seen) == ["multi", "tensor"] and acc.micro_step == 1
    acc.step()
    out = model(x)
    out.register_hook(lambda g: seen.append("removed")).remove()
    handle.remove()
    ((out - y) ** 2).sum().backward()
    assert len(seen) == 2 and acc.micro_step == 2


def test_runner_recovers_from_backward_oom_injected_after_the_wrapper_with_model() -> None:
    from accumopt import MicroBatchRunner
    from accumopt.testing import simulate_oom

    ref, model = twins(mlp(99))
    x, y = data(99, 12)
    full_batch_step(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), x, y)
    acc = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.01), every_items=12, model=model)
    runner = MicroBatchRunner(
        acc, lambda b: ((model(b[0]) - b[1]) ** 2).sum(), loss_reduction="sum"
    )
    with simulate_oom(model, 5, where="backward"):  # the hook lands on the model's output
        runner((x, y))
    assert acc.updates == 1 and runner.ooms > 0
    assert_same_params(model, ref)


@pytest.mark.parametrize("given", [False, True])
def test_opt_backward_after_a_pass_that_died_is_refused_until_it_is_dropped(given: bool) -> None:
    ref, model = twins(mlp(100))
    acc = Accumulate(
        torch.optim.SGD(model.parameters(), lr=1.0), every=2, model=model if given else None
    )
    x, y = data(100, 8)

    def boom(_: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("simulated")

    def arm_boom(_: nn.Module, __: object, out: torch.Tensor) -> None:
        out.register_hook(boom)

    handle = model[0].register_forward_hook(arm_boom)
    with pytest.raises(torch.OutOfMemoryError):
        model(x[:4]).sum().backward()  # dies after the last layer's .grad was written
    handle.remove()
    assert model[2].weight.grad is not None
    with pytest.raises(RuntimeError, match="failed part-way"):
        acc.backward(mse_sum(model, x[:4], y[:4]), items=4)
    acc.discard()
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=1.0), x, y)
    for xb, yb in zip(x.split(4), y.split(4)):
        acc.backward(mse_sum(model, xb, yb), items=4)
        acc.step()
        acc.zero_grad()
    assert acc.updates == 1
    assert_same_params(model, ref)


@pytest.mark.parametrize("then", ["step", "flush"])
def test_step_or_flush_after_a_counted_pass_and_a_dead_one_is_refused(then: str) -> None:
    """A counted micro-step, then a pass that dies before step(): the partial gradient must
    not reach the update."""
    model = mlp(101)
    acc = Accumulate(sgd(model), every=3)
    x, y = data(101, 4)
    mse_sum(model, x[:2], y[:2]).backward()  # counted; step() not called yet

    def boom(_: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("simulated")

    h = model[0](x[2:])
    h.register_hook(boom)
    with pytest.raises(torch.OutOfMemoryError):
        ((model[2](model[1](h)) - y[2:]) ** 2).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="failed part-way"):
        getattr(acc, then)()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    acc.discard()
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())

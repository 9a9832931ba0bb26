"""The private torch APIs accumopt relies on are still there, with the shape it expects.

accumopt supports ``torch>=2.11`` without an upper bound, but a few of the things it uses are
private to torch and may change in any release. This test fails loudly, naming what
disappeared and where accumopt uses it, so that a new torch release breaks here first rather
than somewhere deep in a training run. The list comes from grepping accumopt/ for ``torch._``,
``_pytree``, ``_execution_engine``, ``_foreach``, ``_current_autograd_node``,
``_global_optimizer``, ``_optimizer_*_hooks`` and the like; keep it in sync when accumopt
starts (or stops) using a private name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor


def resolve(dotted: str) -> Any:
    """``torch.a.b.c`` -> the object: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError: reported by the test with the name
        return obj
    raise ImportError(dotted)


def params(obj: Any) -> list[str]:
    return list(inspect.signature(obj).parameters)


def callable_(obj: Any) -> None:
    assert callable(obj), f"{obj!r} is not callable"


def signature(*names: str) -> Callable[[Any], None]:
    def check(obj: Any) -> None:
        callable_(obj)
        assert params(obj)[: len(names)] == list(names), (
            f"expected parameters {names}, found {params(obj)}"
        )

    return check


def mapping(obj: Any) -> None:
    assert hasattr(obj, "values") and hasattr(obj, "__len__"), f"{obj!r} is not a dict of hooks"


def will_engine_execute_node(fn: Any) -> None:
    """Asked inside a backward pass about parameters' AccumulateGrad nodes, as accumopt does."""
    from torch.autograd.graph import get_gradient_edge

    callable_(fn)
    used, unused = (torch.ones(2, requires_grad=True) for _ in range(2))
    y = (used * 2).sum()
    nodes = [get_gradient_edge(p).node for p in (used, unused)]
    seen: list[list[bool]] = []
    y.register_hook(lambda g: seen.append([fn(node) for node in nodes]))
    y.backward()
    assert seen == [[True, False]]


def queue_callback(fn: Any) -> None:
    callable_(fn)
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    ran: list[str] = []
    y.register_hook(lambda g: fn(lambda: ran.append("end of backward")))
    y.backward()
    assert ran == ["end of backward"]


def current_autograd_node(fn: Any) -> None:
    """None outside a backward pass; inside the final callback of a nested (reentrant) pass,
    the node of the outer pass that runs it (how a nested pass is told from a pass)."""
    from torch.utils.checkpoint import checkpoint

    assert fn() is None
    lin = torch.nn.Linear(2, 2)
    seen: list[Any] = []
    lin.weight.register_hook(
        lambda g: torch.autograd.Variable._execution_engine.queue_callback(
            lambda: seen.append(fn())
        )
    )
    checkpoint(lin, torch.ones(1, 2, requires_grad=True), use_reentrant=True).sum().backward()
    assert len(seen) == 1 and seen[0] is not None


def get_scale_async(method: Any) -> None:
    assert params(method) == ["self"], f"expected (self), found {params(method)}"
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    scaler.scale(torch.ones((), requires_grad=True))  # creates the scale tensor
    scale = scaler._get_scale_async()
    assert isinstance(scale, Tensor) and scale.numel() == 1


def per_optimizer_states(_: Any) -> None:
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    p = torch.ones(2, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    flags = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert all(isinstance(f, Tensor) and f.numel() == 1 for f in flags.values()), flags


def post_hooks_ordered(_: Any) -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    first = opt.register_step_post_hook(lambda *_: None)
    second = opt.register_step_post_hook(lambda *_: None)
    opt._optimizer_step_post_hooks.move_to_end(second.id, last=False)
    assert list(opt._optimizer_step_post_hooks) == [second.id, first.id]


def profile_hook_step(fn: Any) -> None:
    assert isinstance(
        inspect.getattr_static(torch.optim.Optimizer, "profile_hook_step"), staticmethod
    )
    signature("func")(fn)


def flatten_dense_tensors(fn: Any) -> None:
    signature("tensors")(fn)
    flat = fn([torch.ones(2), torch.zeros(3)])
    assert flat.shape == (5,)


def foreach_div_(fn: Any) -> None:
    tensors = [torch.full((2,), 4.0), torch.full((3,), 8.0)]
    fn(tensors, 2.0)
    fn(tensors, torch.tensor(2.0))  # the 0-dim tensor divisor accumopt passes on CPU
    assert [t.tolist() for t in tensors] == [[1.0, 1.0], [2.0, 2.0, 2.0]]


def foreach_add_(fn: Any) -> None:
    held = [torch.zeros(2, dtype=torch.float32)]
    fn(held, [torch.ones(2, dtype=torch.bfloat16)])  # type promotion: bf16 into float32
    assert held[0].dtype == torch.float32 and held[0].tolist() == [1.0, 1.0]


def amp_unscale_(fn: Any) -> None:
    grads = [torch.tensor([2.0, float("inf")], dtype=torch.float32)]
    found_inf = torch.zeros((), dtype=torch.float32)
    fn(grads, found_inf, torch.tensor(0.5, dtype=torch.float32))
    assert grads[0][0].item() == 1.0 and found_inf.item() > 0


def tree_flatten_with_path(fn: Any) -> None:
    from torch.utils import _pytree

    flat, _ = fn({"x": [torch.ones(1)]})
    assert _pytree.keystr(flat[0][0]) == "['x'][0]"


def instance_attribute(name: str) -> Callable[[Any], None]:
    def check(_: Any) -> None:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        mapping(getattr(opt, name))

    return check


def tensor_attribute(name: str) -> Callable[[Any], None]:
    def check(_: Any) -> None:
        x = torch.ones(2, requires_grad=True)
        for t in (x * 2, x[:1]):
            getattr(t, name)  # AttributeError: reported as gone

    return check


def sparse_values(_: Any) -> None:
    s = torch.sparse_coo_tensor([[0]], [3.0], (2,), check_invariants=True)
    assert s._values().tolist() == [3.0]


def foreach_norm(f: Any) -> None:
    norms = f([torch.tensor([3.0, 4.0]), torch.tensor([1.0])])
    assert [n.item() for n in norms] == [5.0, 1.0]


def fsdp_state_groups(get_state: Any) -> None:
    """``FSDPModule._get_fsdp_state`` and the per-group ``fsdp_params`` of its state, whose
    held-back gradients ``distributed._drop_fsdp_pending`` drops (a 2-rank run exercises it in
    ``test_fsdp.py``; here the names)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert callable(get_state)
    state = FSDPState()
    assert hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group")
    assert "unsharded_accumulated_grad" in FSDPParam.__annotations__


def batchnorm_base(cls: Any) -> None:
    assert isinstance(torch.nn.BatchNorm1d(2), cls) and isinstance(torch.nn.SyncBatchNorm(2), cls)


# (dotted name, where accumopt uses it, check); ``~`` marks an attribute of an instance (a
# live autograd node, a tensor, an optimizer) rather than a module attribute.
API: list[tuple[str, str, Callable[[Any], None]]] = [
    ("torch._C._will_engine_execute_node", "_counting.py", will_engine_execute_node),
    (
        "torch.autograd.Variable._execution_engine.queue_callback",
        "_counting.py",
        queue_callback,
    ),
    ("torch._C._current_autograd_node", "_counting.py (nested passes)", current_autograd_node),
    ("torch.Tensor~_base", "_counting.py", tensor_attribute("_base")),
    ("torch.Tensor._values", "_grads.py (sparse gradients)", sparse_values),
    ("torch.amp.GradScaler._get_scale_async", "accumulate.py / _buffer.py", get_scale_async),
    (
        "torch.amp.GradScaler~_per_optimizer_states",
        "distributed.py (ranks agree on inf/NaN)",
        per_optimizer_states,
    ),
    ("torch.optim.optimizer._global_optimizer_pre_hooks", "accumulate.py", mapping),
    ("torch.optim.optimizer._global_optimizer_post_hooks", "accumulate.py", mapping),
    ("torch.optim.Optimizer.profile_hook_step", "accumulate.py", profile_hook_step),
    ("torch.Tensor._version", "_guard.py", lambda _: torch.ones(1)._version),
    (
        "torch.optim.Optimizer~_optimizer_step_pre_hooks",
        "accumulate.py",
        instance_attribute("_optimizer_step_pre_hooks"),
    ),
    (
        "torch.optim.Optimizer~_optimizer_step_post_hooks.move_to_end",
        "accumulate.py (a post hook run first)",
        post_hooks_ordered,
    ),
    (
        "torch.optim.Optimizer~_optimizer_step_post_hooks",
        "accumulate.py",
        instance_attribute("_optimizer_step_post_hooks"),
    ),
    (
        "torch.optim.Optimizer~_optimizer_state_dict_pre_hooks",
        "_checkpoint.py",
        instance_attribute("_optimizer_state_dict_pre_hooks"),
    ),
    (
        "torch.optim.Optimizer~_optimizer_state_dict_post_hooks",
        "_checkpoint.py",
        instance_attribute("_optimizer_state_dict_post_hooks"),
    ),
    (
        "torch.optim.Optimizer~_optimizer_load_state_dict_pre_hooks",
        "_checkpoint.py",
        instance_attribute("_optimizer_load_state_dict_pre_hooks"),
    ),
    (
        "torch.optim.Optimizer~_optimizer_load_state_dict_post_hooks",
        "_checkpoint.py",
        instance_attribute("_optimizer_load_state_dict_post_hooks"),
    ),
    ("torch.utils._pytree.tree_flatten_with_path", "_tree.py", tree_flatten_with_path),
    ("torch.utils._pytree.keystr", "_tree.py", signature("kp")),
    ("torch.utils._pytree.tree_unflatten", "_tree.py", signature("leaves", "treespec")),
    ("torch.utils._pytree.tree_leaves", "_counting.py, _tree.py", signature("tree")),
    ("torch.utils._pytree.tree_is_leaf", "_tree.py", signature("tree")),
    ("torch.utils._pytree.tree_map_with_path", "_tree.py", signature("func", "tree")),
    ("torch.utils._pytree.register_pytree_node", "_tree.py", signature("cls", "flatten_fn")),
    ("torch._utils._flatten_dense_tensors", "distributed.py", flatten_dense_tensors),
    ("torch._utils._unflatten_dense_tensors", "distributed.py", signature("flat", "tensors")),
    ("torch._foreach_div_", "_grads.py", foreach_div_),
    ("torch._foreach_add_", "_buffer.py", foreach_add_),
    ("torch._amp_foreach_non_finite_check_and_unscale_", "_grads.py", amp_unscale_),
    ("torch.nn.modules.batchnorm._BatchNorm", "batchnorm.py", batchnorm_base),
    (
        "torch.Tensor~_post_accumulate_grad_hooks",
        "_buffer.py (each parameter hooked once)",
        tensor_attribute("_post_accumulate_grad_hooks"),
    ),
    ("torch._foreach_norm", "noise.py (noise scale)", foreach_norm),
    (
        "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
        "distributed.py (a discarded FSDP2 window)",
        fsdp_state_groups,
    ),
]


@pytest.mark.parametrize(
    ("name", "used_in", "check"), API, ids=[name.replace("~", ".") for name, _, _ in API]
)
def test_private_torch_api_is_still_there(
    name: str, used_in: str, check: Callable[[Any], None]
) -> None:
    owner, _, member = name.partition("~")
    where = f"torch {torch.__version__}: {name.replace('~', '.')} (used by accumopt/{used_in})"
    try:
        obj = resolve(owner)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{where} is gone: {type(err).__name__}: {err}", pytrace=False)
    try:
        check(obj if not member else None)
    except AttributeError as err:
        pytest.fail(f"{where} is gone: {err}", pytrace=False)
    except Exception as err:
        pytest.fail(f"{where} changed: {type(err).__name__}: {err}", pytrace=False)

"""accumopt.testing.simulate_oom: both forms (context manager, plain call + remove())."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accumopt import is_oom
from accumopt.testing import SimulatedOOM, simulate_oom


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def test_context_manager_form_raises_inside_and_removes_its_hooks() -> None:
    net = model()
    with simulate_oom(net, 4) as sim:
        assert isinstance(sim, SimulatedOOM) and sim.active
        net(torch.zeros(4, 3))  # fits
        with pytest.raises(torch.OutOfMemoryError, match="5 rows > limit 4") as err:
            net(torch.zeros(5, 3))
        assert is_oom(err.value)
    assert not sim.active and hooks(net) == 0
    net(torch.zeros(50, 3))  # no limit any more
    assert sim.sizes == [4, 5] and sim.raised == [5]


def test_plain_call_installs_the_hooks_until_remove() -> None:
    net = model()
    sim = simulate_oom(net, 2, kind="cpu")
    assert sim.active and hooks(net) == 1
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator") as err:
        net(torch.zeros(3, 3))
    assert is_oom(err.value)
    sim.remove()
    assert not sim.active and hooks(net) == 0
    net(torch.zeros(30, 3))
    assert sim.sizes == [3] and sim.raised == [3]
    sim.remove()  # removing twice is harmless


def test_plain_call_backward_fails_after_the_later_layers_wrote_their_gradients() -> None:
    net = model()
    sim = simulate_oom(net, 2, where="backward", at=net[0])
    assert hooks(net) == 2
    out = net(torch.ones(3, 3)).sum()  # the forward pass runs
    with pytest.raises(torch.OutOfMemoryError):
        out.backward()
    assert net[2].weight.grad is not None  # behind the failure point: already written
    assert net[0].weight.grad is None  # the failure struck before this layer
    sim.remove()
    assert hooks(net) == 0
    net(torch.ones(3, 3)).sum().backward()
    assert net[0].weight.grad is not None
    assert sim.raised == [3]


def test_a_removed_simulation_cannot_be_entered_again() -> None:
    net = model()
    sim = simulate_oom(net, 1)
    with sim:
        pass
    with pytest.raises(RuntimeError, match="already removed"), sim:
        pass


def test_hooks_are_removed_when_the_block_raises() -> None:
    net = model()
    with pytest.raises(torch.OutOfMemoryError), simulate_oom(net, 1):
        net(torch.zeros(2, 3))
    assert hooks(net) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"limit": -1}, "limit=-1"),
        ({"limit": 1.5}, "limit=1.5"),
        ({"limit": 1, "where": "sideways"}, "where='sideways'"),
        ({"limit": 1, "kind": "tpu"}, "kind='tpu'"),
    ],
)
def test_bad_arguments_are_refused_before_any_hook(kwargs: dict[str, object], match: str) -> None:
    net = model()
    with pytest.raises(ValueError, match=match):
        simulate_oom(net, **kwargs)  # type: ignore[arg-type]
    assert hooks(net) == 0

"""The checkpoint format: one format (4), packed in param group 0, every field checked before
anything loads; accumopt 0.1's formats are refused with what to do."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import entry_of, with_entry
from torch import nn

from accumopt import Accumulate
from accumopt._checkpoint import FORMAT

DATA = Path(__file__).parent / "data"


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _mid_window(opt_factory: Any = None, **kw: Any) -> tuple[nn.Module, Accumulate]:
    """One update (AdamW state), then one micro-step of the next window."""
    model = _model()
    make = opt_factory or (lambda p: torch.optim.AdamW(p, lr=0.1))
    opt = Accumulate(make(model.parameters()), every=2, **kw)
    for _ in range(3):
        model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_0_1_checkpoint_is_refused_with_what_to_do() -> None:
    """accumopt 0.1 wrote its entry at the top level (formats 1-3): refused before anything
    loads, never taken for a bare optimizer's state dict (its window would be lost)."""
    ckpt = torch.load(DATA / "checkpoint_format1.pt", weights_only=False)
    assert ckpt["optimizer"]["accumopt"]["version"] == 1
    model = _model()
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=4)
    with pytest.raises(ValueError, match=r"format of accumopt 0\.1"):
        opt.load_state_dict(ckpt["optimizer"])
    assert opt.updates == 0 and not opt.optimizer.state


def test_state_dict_writes_the_current_format_in_param_group_0() -> None:
    model = _model()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    state = opt.state_dict()
    assert "accumopt" not in state and isinstance(state["param_groups"][0]["accumopt"], bytes)
    entry = entry_of(state)
    assert entry["format"] == FORMAT == 4
    assert entry["state"]["micro_step"] == 1 and set(entry["grads"]) == {0, 1, 2, 3}


def test_a_mid_window_checkpoint_resumes_bit_for_bit() -> None:
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)

    def step(model: nn.Module, opt: Accumulate, a: int, b: int) -> None:
        opt.backward(((model(x[a:b]) - y[a:b]) ** 2).sum(), items=b - a)
        opt.step()
        opt.zero_grad()

    model = _model()
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=4)
    cuts = [(0, 3), (3, 4), (4, 6), (6, 10), (0, 2), (2, 5)]
    for a, b in cuts[:5]:
        step(model, opt, a, b)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    step(model, opt, *cuts[5])
    resumed_model = _model()
    resumed_model.load_state_dict(saved["model"])
    resumed = Accumulate(torch.optim.AdamW(resumed_model.parameters(), lr=0.1), every=4)
    resumed.load_state_dict(saved["opt"])
    assert (resumed.micro_step, resumed.items, resumed.updates) == (1, 2.0, 1)
    step(resumed_model, resumed, *cuts[5])
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


def test_an_unknown_format_is_refused_and_changes_nothing() -> None:
    model = _model()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    state = copy.deepcopy(opt.state_dict())
    state = with_entry(state, {**entry_of(state), "format": 99})
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="format 99"):
        opt.load_state_dict(state)
    assert opt.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_checkpoint_for_other_parameter_shapes_is_refused_and_changes_nothing() -> None:
    other = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    src = Accumulate(torch.optim.AdamW(other.parameters(), lr=0.1), every=2)
    for _ in range(3):
        other(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        src.step()
        src.zero_grad()
    opt = Accumulate(torch.optim.AdamW(_model().parameters(), lr=0.1), every=2)
    before = copy.deepcopy(opt.optimizer.state_dict())
    with pytest.raises(ValueError, match="parameter groups and sharding it was saved with"):
        opt.load_state_dict(copy.deepcopy(src.state_dict()))
    assert opt.optimizer.state_dict() == before and opt.updates == 0 and opt.micro_step == 0


@pytest.mark.parametrize(
    ("rank", "match"),
    [
        ([1, 2], "saved by rank 1 of 2, and is loaded on rank 0 of 1"),
        ([0, 4], "saved by rank 0 of 4"),
        ([2, 2], "changed or damaged"),
        ("rank 0", "changed or damaged"),
    ],
)
def test_a_window_saved_on_another_rank_or_world_is_refused_and_changes_nothing(
    rank: object, match: str
) -> None:
    """A window's gradient and items are the saving rank's own: its ``[rank, ranks]`` must be
    this process's (``[0, 1]`` without a DDP/FSDP2 model); a malformed one is damage."""
    model = _model()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    state = copy.deepcopy(opt.state_dict())
    assert entry_of(state)["rank"] == [0, 1]
    opt.step()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(with_entry(state, {**entry_of(state), "rank": rank}))
    assert opt.micro_step == 1 and opt.updates == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def _state(key: str, value: Any) -> Any:
    return lambda e: e["state"].update({key: value})


DAMAGES = {
    "updates-str": _state("updates", "12"),
    "updates-missing": lambda e: e["state"].pop("updates"),
    "updates-negative": _state("updates", -1),
    "items-seen-nan": _state("items_seen", float("nan")),
    "found_inf": lambda e: e.update(found_inf=1.0),
    "grads-key": lambda e: e.update(grads={"0": torch.zeros(4, 3)}),
    "sums-list": lambda e: e.update(sums=[]),
    "state-str": lambda e: e.update(state="open"),
    "closed-not-full": _state("closed", True),
    "size-str": _state("size", "three"),
    "past-its-size": _state("micro_step", 3),
    "micro-step-negative": _state("micro_step", -1),
    "items-negative": _state("items", -2.0),
    "closed-str": _state("closed", "yes"),
    "unfolded-negative": lambda e: e.update(unfolded=-3),
    "noise-sums": lambda e: e["noise_scale"].update(sums=[1.0]),
    "noise-decay": lambda e: e["noise_scale"].update(decay=7.0),
    "noise-every": lambda e: e["noise_scale"].update(every_windows=0),
    "noise-per-step": lambda e: e["noise_scale"].update(batch_per_micro_step="2"),
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_a_damaged_entry_is_refused_before_anything_is_loaded(damage: Any) -> None:
    """Each field is checked before the inner optimizer, the window or the noise-scale averages
    load: a ValueError that names the damage, and the wrapper exactly as before."""
    model, opt = _mid_window(noise_scale=True)
    state = copy.deepcopy(opt.state_dict())
    entry = entry_of(state)
    damage(entry)
    state = with_entry(state, entry)
    fresh = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=2, noise_scale=True)
    before = copy.deepcopy(fresh.optimizer.state_dict())
    with pytest.raises(ValueError, match="damaged"):
        fresh.load_state_dict(state)
    assert fresh.optimizer.state_dict() == before and fresh.updates == 0
    assert fresh.micro_step == 0 and fresh.noise_scale.windows == 0  # type: ignore[union-attr]


class Sized:
    """A window schedule with a state the checkpoint carries, loaded field by field (a bad
    state half-loads it), holding a lock (it cannot be copied)."""

    def __init__(self) -> None:
        self.size, self.seen, self.lock = 2, 0, threading.Lock()

    def __call__(self, updates: int, items_seen: float) -> int:
        self.seen += 1
        return self.size

    def state_dict(self) -> dict[str, int]:
        return {"size": self.size, "seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.size = int(state["size"])
        self.seen = int(state["seen"])


def _scheduled_state() -> tuple[nn.Module, dict[str, Any]]:
    model, opt = _mid_window(lambda p: torch.optim.AdamW(p, lr=0.1))
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=Sized())
    for _ in range(3):
        model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, copy.deepcopy(opt.state_dict())


def test_a_schedule_state_that_does_not_load_is_refused_before_anything_is_loaded() -> None:
    model, state = _scheduled_state()
    entry = entry_of(state)
    entry["schedule_state"] = {"size": 5}  # "seen" lost
    schedule = Sized()
    fresh = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=schedule)
    before = copy.deepcopy(fresh.optimizer.state_dict())
    with pytest.raises(ValueError, match="schedule state"):
        fresh.load_state_dict(with_entry(state, entry))
    assert fresh.optimizer.state_dict() == before and fresh.updates == 0
    assert schedule.size == 2  # the trial load was undone


def test_an_intact_schedule_state_loads_into_a_schedule_that_cannot_be_copied() -> None:
    model, state = _scheduled_state()
    schedule = Sized()
    fresh = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=schedule)
    fresh.load_state_dict(state)
    assert fresh.updates == 1 and fresh.micro_step == 1


class Logged:
    """A window schedule whose state_dict() hands out its live state, and whose load appends
    to it (loading twice would show) after clearing it (a failed load would empty it)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"log": [], "size": 2}

    def __call__(self, updates: int, items_seen: float) -> int:
        return int(self.state["size"])

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        log = list(state["log"])
        self.state.clear()
        self.state.update(log=[*log, "loaded"], size=state["size"])


def test_a_schedule_state_is_loaded_once_and_a_failed_load_is_undone() -> None:
    model = _model()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=Logged())
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    state = copy.deepcopy(opt.state_dict())
    schedule = Logged()
    fresh = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=schedule)
    damaged = entry_of(state)
    del damaged["schedule_state"]["size"]
    with pytest.raises(ValueError, match="schedule state"):
        fresh.load_state_dict(with_entry(state, damaged))
    assert schedule.state["size"] == 2  # restored by loading its state from before
    fresh.load_state_dict(state)
    assert schedule.state == {"log": ["loaded"], "size": 2} and fresh.micro_step == 1


def test_the_entry_survives_torch_save_and_a_weights_only_load(tmp_path: Path) -> None:
    model, opt = _mid_window()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=2)
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert (fresh.micro_step, fresh.updates) == (1, 1)


def test_a_window_wiped_outside_the_wrapper_is_not_saved() -> None:
    """A window whose gradients were cleared by code outside the wrapper is refused at the
    save, not written into a checkpoint that would resume it as if it were whole."""
    model = torch.nn.Linear(3, 2).double()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=4)
    for _ in range(2):
        model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
    model.weight.grad.zero_()  # a framework's own zeroing, say
    with pytest.raises(RuntimeError, match=r"replaced or cleared.*Nothing was saved"):
        opt.state_dict()

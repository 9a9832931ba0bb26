"""The checkpoint format: versioned, and today's accumopt loads what accumopt 0.1.0 wrote.

``tests/data/checkpoint_format1*.pt`` were written by accumopt 0.1.0 (format 1, the entry's
``"version": 1``): a float64 MLP, ``Accumulate(AdamW(lr=0.1), every=4)`` (and ``buffer=True``)
fed weighted micro-batches of 3, 1, 2 and 4 rows; one full window, then two micro-steps of the
second, saved mid-window. ``"expected"`` holds the parameters 0.1.0 reached after finishing that
window, so a resumed run must reproduce them: to within 4 float64 ulps (2 ulps apart on
2026-12-02, on a machine with other vector kernels than the one that wrote them: AVX-512
against AVX2, another reduction order). A lost or repeated micro-step, or a window divided by
another count, moves them by orders of magnitude more.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accumopt import Accumulate
from accumopt._checkpoint import FORMAT

DATA = Path(__file__).parent / "data"
OFFSETS = [0, 3, 4, 6, 10]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


@pytest.mark.parametrize(
    ("name", "buffer"),
    [("checkpoint_format1.pt", None), ("checkpoint_format1_buffer.pt", True)],
)
def test_a_format_1_checkpoint_resumes_mid_window_to_the_last_ulps(
    name: str, buffer: bool | None
) -> None:
    ckpt = torch.load(DATA / name, weights_only=False)
    assert ckpt["optimizer"]["accumopt"]["version"] == 1  # written by the old format
    model = _model()
    model.load_state_dict(ckpt["model"])
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=4, buffer=buffer)
    opt.load_state_dict(ckpt["optimizer"])
    assert (opt.micro_step, opt.items, opt.updates) == (2, 4.0, 1)
    x, y = ckpt["x"], ckpt["y"]
    for i in (2, 3):
        xb, yb = x[OFFSETS[i] : OFFSETS[i + 1]], y[OFFSETS[i] : OFFSETS[i + 1]]
        opt.backward(((model(xb) - yb) ** 2).sum(), items=xb.shape[0])
        opt.step()
        opt.zero_grad()
    assert opt.did_update and opt.updates == 2
    for key, value in model.state_dict().items():
        eps = torch.finfo(value.dtype).eps
        torch.testing.assert_close(value, ckpt["expected"][key], rtol=4 * eps, atol=4 * eps)


def test_state_dict_writes_the_current_format_number() -> None:
    model = _model()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    entry = opt.state_dict()["accumopt"]
    assert entry["format"] == FORMAT == 3
    assert entry["window"]["micro_step"] == 1


def test_an_unknown_format_is_refused_and_changes_nothing() -> None:
    model = _model()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    state = copy.deepcopy(opt.state_dict())
    state["accumopt"]["format"] = 99
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="format 99"):
        opt.load_state_dict(state)
    assert opt.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_checkpoint_for_other_parameter_shapes_is_refused_and_changes_nothing() -> None:
    small, other = _model(), nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    src = Accumulate(torch.optim.AdamW(other.parameters(), lr=0.1), every=2)
    for _ in range(3):  # one update (AdamW state), then one micro-step of the next window
        other(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        src.step()
        src.zero_grad()
    opt = Accumulate(torch.optim.AdamW(small.parameters(), lr=0.1), every=2)
    before = copy.deepcopy(opt.optimizer.state_dict())
    with pytest.raises(ValueError, match="same model"):
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
    assert state["accumopt"]["window"]["rank"] == [0, 1]
    opt.step()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    state["accumopt"]["window"]["rank"] = rank
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)
    assert opt.micro_step == 1 and opt.updates == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_window_without_a_rank_loads_as_before() -> None:
    """Entries written before the window recorded its rank load where they are given."""
    model = _model()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    state = copy.deepcopy(opt.state_dict())
    del state["accumopt"]["window"]["rank"]
    fresh = Accumulate(torch.optim.SGD(_model().parameters(), lr=0.1), every=2)
    fresh.load_state_dict(state)
    assert fresh.micro_step == 1


def _noise(state: dict) -> None:
    state["noise_scale"]["sums"] = [1.0]


@pytest.mark.parametrize(
    "damage",
    [
        lambda e: e.update(updates="12"),
        lambda e: e.pop("updates"),
        lambda e: e.update(updates=-1),
        lambda e: e["schedule"].update(updates=None),
        lambda e: e["schedule"].update(items_seen=float("nan")),
        lambda e: e["window"].update(found_inf=1.0),
        lambda e: e["window"].update(grads={"0": torch.zeros(4, 3)}),
        lambda e: e["window"].update(buffer=[]),
        lambda e: e.update(window="open"),
        lambda e: e["window"].update(closed=True),
        lambda e: e["window"].update(size="three"),
        lambda e: e["window"].update(micro_step=3),
        _noise,
        lambda e: e["noise_scale"].update(decay=7.0),
        lambda e: e["noise_scale"].update(every_windows=0),
        lambda e: e["noise_scale"].update(batch_per_micro_step="2"),
    ],
    ids=[
        "updates-str",
        "updates-missing",
        "updates-negative",
        "schedule-updates",
        "schedule-items",
        "found_inf",
        "grads-key",
        "buffer-list",
        "window-str",
        "window-closed-not-full",
        "window-size",
        "window-past-its-size",
        "noise-sums",
        "noise-decay",
        "noise-every",
        "noise-per-step",
    ],
)
def test_a_damaged_entry_is_refused_before_anything_is_loaded(damage: Any) -> None:
    """Each field is checked before the inner optimizer, the window or the noise-scale averages
    load: a ValueError that names the field, and the wrapper exactly as before."""
    model = _model()
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=2, noise_scale=True)
    for _ in range(3):  # one update (AdamW state), then one micro-step of the next window
        model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = copy.deepcopy(opt.state_dict())
    damage(state["accumopt"])
    fresh = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=2, noise_scale=True)
    opt = None  # only the fresh wrapper counts from here
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
    model = _model()
    opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=Sized())
    for _ in range(3):  # one update, then one micro-step of the next window
        model(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, copy.deepcopy(opt.state_dict())


def test_a_schedule_state_that_does_not_load_is_refused_before_anything_is_loaded() -> None:
    model, state = _scheduled_state()
    state["accumopt"]["schedule"]["schedule_state"] = {"size": 5}  # "seen" lost
    schedule = Sized()
    fresh = Accumulate(torch.optim.AdamW(model.parameters(), lr=0.1), every=schedule)
    before = copy.deepcopy(fresh.optimizer.state_dict())
    with pytest.raises(ValueError, match="schedule state"):
        fresh.load_state_dict(state)
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
    damaged = copy.deepcopy(state)
    del damaged["accumopt"]["schedule"]["schedule_state"]["size"]
    with pytest.raises(ValueError, match="schedule state"):
        fresh.load_state_dict(damaged)
    assert schedule.state["size"] == 2  # restored by loading its state from before
    fresh.load_state_dict(state)
    assert schedule.state == {"log": ["loaded"], "size": 2} and fresh.micro_step == 1

"""Host-device synchronisations from accumopt's own code, counted on the documented paths.

Every way a tensor's value reaches the host (``.item()``, ``.tolist()``, ``bool()``,
``float()``, ``int()`` of a tensor) is counted when accumopt's code asks for it (a frame of the
package within three levels of the call). On the CPU these are cheap, but on an accelerator each
one waits for the device: the loop must not pay one per micro-step. The promises: none at all
with integer item counts or mean losses; with item counts given as tensors in a window counted
in micro-steps, one per window (read at its close), none inside it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accumopt
from accumopt import Accumulate, MicroBatchRunner, TokenBudget

PACKAGE = os.path.dirname(accumopt.__file__)
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextmanager
def counted_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record ``file:line`` of each host read accumopt's code makes inside the block."""
    seen: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *a: Any, _o: Any = original, **k: Any) -> Any:
            frame = sys._getframe(1)
            for _ in range(3):
                if frame is None:
                    break
                if frame.f_code.co_filename.startswith(PACKAGE):
                    seen.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
                    break
                frame = frame.f_back
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    try:
        yield seen
    finally:
        monkeypatch.undo()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_sum(model: nn.Module, i: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(i)
    rows = 1 + i % 3
    x, y = torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)
    return ((model(x) - y) ** 2).sum(), rows


Step = Callable[[Accumulate, nn.Module, int], None]


def weighted_int(opt: Accumulate, model: nn.Module, i: int) -> None:
    loss, rows = loss_sum(model, i)
    opt.backward(loss, items=rows)


def weighted_tensor(opt: Accumulate, model: nn.Module, i: int) -> None:
    loss, rows = loss_sum(model, i)
    opt.backward(loss, items=torch.tensor(rows))


def next_items_tensor(opt: Accumulate, model: nn.Module, i: int) -> None:
    loss, rows = loss_sum(model, i)
    opt.next_items(torch.tensor(rows))
    loss.backward()


def mean_loss(opt: Accumulate, model: nn.Module, i: int) -> None:
    loss, rows = loss_sum(model, i)
    (loss / rows).backward()


@pytest.mark.parametrize(
    ("micro_step", "per_window"),
    [(weighted_int, 0), (mean_loss, 0), (weighted_tensor, 1), (next_items_tensor, 1)],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
@pytest.mark.parametrize("given", [False, True], ids=["parameters", "model="])
def test_no_host_sync_inside_a_window(
    micro_step: Step, per_window: int, given: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    every, windows = 4, 3
    model = net()
    opt = Accumulate(
        torch.optim.AdamW(model.parameters(), lr=0.01), every=every, model=model if given else None
    )
    with counted_syncs(monkeypatch) as seen:
        at_micro_steps: list[list[str]] = []
        for i in range(every * windows):
            before = len(seen)
            micro_step(opt, model, i)
            opt.step()
            opt.zero_grad()
            at_micro_steps.append(seen[before:])
    assert opt.updates == windows
    inside = [syncs for i, syncs in enumerate(at_micro_steps) if (i + 1) % every]
    assert inside == [[]] * len(inside)  # none inside a window
    at_close = [syncs for i, syncs in enumerate(at_micro_steps) if not (i + 1) % every]
    assert [len(s) for s in at_close] == [per_window] * windows, at_close


def test_the_runner_with_integer_items_syncs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = net()
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=12)
    x, y = torch.randn(24, 4), torch.randn(24, 2)
    runner = MicroBatchRunner(
        opt,
        lambda b: (((model(b[0]) - b[1]) ** 2).sum(), len(b[0])),
        micro_batch_size=4,
        loss_reduction="sum",
    )
    with counted_syncs(monkeypatch) as seen:
        runner((x, y))
    assert opt.updates == 2 and seen == []


@pytest.mark.parametrize("tokens", [12, "auto"])
def test_the_budget_runner_reads_its_counts_once_per_call(
    tokens: int | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``budget=``: each micro-step's items are summed on the host from the per-row counts,
    which are read once per call (reads of host tensors: the lengths and the loss-bearing tokens,
    and the check that the trimmed leaves hold padding past each row's length; no device sync),
    none per micro-step, also in windows the runner flushes."""
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=math.inf)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 6, (16,), generator=g)
    labels = torch.where(torch.arange(6) < lengths[:, None], 1, -100)
    ids = torch.where(torch.arange(6) < lengths[:, None], torch.randint(1, 5, (16, 6)), 0)
    batch = {"ids": ids, "labels": labels, "lengths": lengths}
    spec = TokenBudget(
        tokens,  # type: ignore[arg-type]
        cost=lambda b: b["lengths"],
        items=lambda b: (b["labels"] != -100).sum(1),
        padded=True,
        rows_per_update=8,
    )
    steps = [0]

    def loss_fn(b: dict[str, torch.Tensor]) -> torch.Tensor:
        steps[0] += 1
        logits = model(b["ids"])
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum")

    runner = MicroBatchRunner(opt, loss_fn, budget=spec, start_size=6, loss_reduction="sum")
    with counted_syncs(monkeypatch) as seen:
        runner(batch)
    assert opt.updates == 2 and steps[0] > 2
    # the counts (2 reads), and the padding check of the 2 trimmed leaves (3): all per call
    assert [where.split(":")[0] for where in seen] == ["budget.py"] * 5, seen

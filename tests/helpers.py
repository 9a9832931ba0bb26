"""Test helpers: float64 twin models, optimizer factories, and the full-batch reference."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

OptFactory = Callable[[list[nn.Parameter] | list[dict[str, object]]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptFactory] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum_nesterov_wd": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def mlp(seed: int, n_in: int = 4, hidden: int = 6, n_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out))


def twins(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Two identical copies: one for the reference loop, one for accumopt."""
    return copy.deepcopy(model), copy.deepcopy(model)


def data(seed: int, n: int, n_in: int = 4, n_out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n, n_in, generator=g), torch.randn(n, n_out, generator=g)


def mse_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y, reduction="sum")


def full_batch_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """The reference: one plain step on the mean loss of the whole window."""
    opt.zero_grad()
    (mse_sum(model, x, y) / len(x)).backward()
    opt.step()


def split_sizes(x: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(x.split(list(sizes)))


def assert_same_params(
    a: nn.Module, b: nn.Module, rtol: float = 1e-10, atol: float = 1e-12
) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def scenarios_on_ranks(module: str, table: str, timeout_s: float = 120) -> list[dict[str, Any]]:
    """Run every scenario of the dict ``module.table`` (name -> function of the rank) in one
    spawn of 2 gloo ranks (spawning costs seconds); each rank's results by scenario name."""
    from accumopt.testing import run_ranks

    return run_ranks(_scenarios, module, table, timeout_s=timeout_s)


def _scenarios(rank: int, module: str, table: str) -> dict[str, Any]:
    scenarios = getattr(importlib.import_module(module), table)
    return {name: run(rank) for name, run in scenarios.items()}


def torchrun_example(script: str, *args: str, timeout_s: float = 300) -> str:
    """Run ``examples/<script>`` as 2 DDP processes (``torchrun --standalone``, gloo) and
    return its standard output; fail with its standard error if it failed.

    Known, not accumopt's: now and then a torchrun child aborts at interpreter exit
    ("terminate called without an active exception", seen with Lightning's DDP in about 1
    run in 10) after the script has finished; such a run counts when the script's last line
    ("held-out accuracy" or "training loss") was printed, as everything checked is printed
    before it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(root / "examples" / script), *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=root)
    finished = "held-out accuracy" in run.stdout or "training loss" in run.stdout
    exit_abort = "terminate called without an active exception" in run.stderr
    assert run.returncode == 0 or (exit_abort and finished), run.stderr[-3000:]
    return run.stdout


def entry_of(state: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's checkpoint entry of a state dict (unpacked from param group 0)."""
    from accumopt._checkpoint import entry_of as unpack

    found = unpack(state)
    assert found is not None
    return found


def with_entry(state: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` whose checkpoint entry is ``entry`` (packed as state_dict() does)."""
    from accumopt._checkpoint import KEY, pack

    groups = [dict(g) for g in state["param_groups"]]
    groups[0][KEY] = pack(entry)
    return {**state, "param_groups": groups}

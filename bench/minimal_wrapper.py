"""The floor of an exact accumulation wrapper that counts backward passes at the parameters.

A minimal wrapper (no AMP, DDP, schedules, item weights, interrupt safety, framework checks or
hooks): one pre-hook per parameter tensor on its ``AccumulateGrad`` node (the nodes kept alive:
a hook on a node nothing holds never fires), one end-of-backward callback per pass, an O(1)
sentinel check of one ``.grad`` per micro-step, the learning rates compared and one division at
the boundary. It is timed against the hand loop (``(loss / k).backward()``, copies A and B) and
``Accumulate`` in random order each round (thread CPU, garbage collection off, 1 thread); the
ratios are medians over rounds with their interquartile range. Issue 31's figures: what part of
accumopt's overhead is counting itself, what part the rest of the wrapper.

Run: ``python bench/minimal_wrapper.py [--rounds 60]``. A diagnostic, not a pytest benchmark.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge

from accumopt import Accumulate

OPEN, PASS, CLOSED = range(3)


class Minimal:
    """Steps ``optimizer`` once every ``k`` counted backward passes, on their mean gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int) -> None:
        self.optimizer, self.k = optimizer, k
        self.phase, self.micro_step, self.stepped = OPEN, 0, True
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.nodes = [get_gradient_edge(p).node for p in self.params]  # kept alive
        self.noted: tuple[Any, int, int, list[Any]] = (None, 0, 0, [])
        queue, end = Variable._execution_engine.queue_callback, self._end

        def begin(*_: Any) -> None:  # one frame per hook call: the floor
            if self.phase == OPEN:
                self.phase = PASS
                queue(end)

        for node in self.nodes:
            node.register_prehook(begin)

    def _end(self) -> None:
        self.micro_step += 1
        self.stepped = False
        grad = self.params[0].grad
        assert grad is not None
        if self.micro_step == 1:
            lrs = [g["lr"] for g in self.optimizer.param_groups]
            self.noted = (grad, grad._version, 0, lrs)
        else:
            noted, version, passes, lrs = self.noted
            if grad is not noted or grad._version > version + passes + 1:
                raise RuntimeError("the window's .grad was cleared or replaced")
            self.noted = (noted, version, passes + 1, lrs)
        if self.micro_step >= self.k:
            with torch.no_grad():
                torch._foreach_div_([p.grad for p in self.params], float(self.micro_step))
            self.phase = CLOSED
        else:
            self.phase = OPEN

    def step(self) -> None:
        if self.phase == OPEN and not self.stepped:
            self.stepped = True
        elif self.phase == CLOSED:
            if [g["lr"] for g in self.optimizer.param_groups] != self.noted[3]:
                raise RuntimeError("a learning rate changed inside the window")
            self.optimizer.step()
            self.micro_step, self.phase, self.stepped = 0, OPEN, True
        else:
            raise RuntimeError("no backward pass since the last step()")

    def zero_grad(self) -> None:
        if self.micro_step == 0:
            self.optimizer.zero_grad()


def model_of(name: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    if name == "tiny MLP":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), 32
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(50)]), 16


def window(name: str, base: nn.Module, data: list[Any], k: int) -> Callable[[], None]:
    model = copy.deepcopy(base)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    if name.startswith("hand"):
        opt: Any = inner

        def hand() -> None:
            for x, y in data:
                loss = F.mse_loss(model(x), y)
                (loss / k if k > 1 else loss).backward()
            opt.step()
            opt.zero_grad()

        return hand
    opt = Minimal(inner, k) if name == "minimal" else Accumulate(inner, every=k)

    def wrapped() -> None:
        for x, y in data:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    return wrapped


def thread_ns(run: Callable[[], None], repeat: int) -> int:
    start = time.thread_time_ns()
    for _ in range(repeat):
        run()
    return time.thread_time_ns() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    rounds = parser.parse_args(argv).rounds
    torch.set_num_threads(1)
    print("| model | k | hand B / A | minimal / A | Accumulate / A |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in ("tiny MLP", "100 tensors"):
        for k in (1, 8):
            base, width = model_of(name)
            out = base(torch.zeros(1, width)).shape[-1]
            data = [(torch.randn(32, width), torch.randn(32, out)) for _ in range(k)]
            runs = {c: window(c, base, data, k) for c in ("hand", "hand B", "minimal", "accumopt")}
            repeat = max(1, 20 // k) if name == "tiny MLP" else 2
            gc.disable()
            for run in runs.values():
                thread_ns(run, repeat)
            ratios: dict[str, list[float]] = {c: [] for c in ("hand B", "minimal", "accumopt")}
            for _ in range(rounds):
                order = list(runs.items())
                random.shuffle(order)
                took = {c: thread_ns(run, repeat) for c, run in order}
                for c, got in ratios.items():
                    got.append(took[c] / took["hand"])
            gc.enable()
            cells = []
            for got in ratios.values():
                q = statistics.quantiles(got, n=4)
                cells.append(f"{statistics.median(got):.3f} ({q[0]:.2f}-{q[2]:.2f})")
            print(f"| {name} | {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

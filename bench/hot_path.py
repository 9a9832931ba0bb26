"""Where a micro-step's time goes: the pieces of accumopt's hot path, timed one by one.

Each line of the table is the difference between two loops run interleaved (alternating
order, garbage collection off, 1 torch thread, thread CPU clock), as a median over rounds, so
that machine noise hits both sides alike:

- ``loss / k`` in the hand loop: ``(loss / k).backward()`` against ``loss.backward()``, per
  micro-step (tiny MLP);
- one hook call per parameter tensor: ``loss.backward()`` with a no-op hook on every parameter
  against none, per pass and per tensor (50 x Linear(16, 16)), for the three kinds torch offers:
  a pre-hook on the ``AccumulateGrad`` node (accumopt's default counting), a tensor hook, and a
  post-accumulate-grad hook;
- accumopt inside a window (backward, ``step()``, ``zero_grad()``; the window never closes,
  and is discarded after k micro-steps) against k plain backward passes and one
  ``zero_grad()``, counting at the parameters and at the outputs (``model=``), on both models:
  all that counting costs, per pass;
- the bare mechanism of counting at the outputs, with nothing accumopt does around it: a
  forward hook that puts a hook on the output, which queues an end-of-backward callback that
  queues a second one (as accumopt's counter does), against plain passes (tiny MLP);
- counting's floor: the hooks and callbacks of counting at the parameters with nothing done in
  them, and one division a window, against the hand loop's ``loss / k`` (tiny MLP);
- accumopt's own cost per micro-step, the same way on a model of one parameter tensor
  (``Linear(1, 1, bias=False)``): one hook call, the end-of-backward callbacks, ``step()`` and
  ``zero_grad()`` (public API only);
- the boundary division of 100 CPU gradients by a Python number against a cached 0-dim tensor.

Run: ``python bench/hot_path.py [--rounds 200]``. A diagnostic, not one of the pytest
benchmarks and not part of ``run_all.py``; the figures quoted in RESULTS.md come from it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
import timeit
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import markdown_table, quartiles
from torch import Tensor, nn

from accumopt import Accumulate

K = 8


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def hundred() -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(50)])


def batches(model: nn.Module, width: int) -> list[tuple[Tensor, Tensor]]:
    out = model(torch.zeros(1, width)).shape[-1]
    return [(torch.randn(32, width), torch.randn(32, out)) for _ in range(K)]


def passes(model: nn.Module, data: list[tuple[Tensor, Tensor]], scale: bool) -> Callable[[], None]:
    """k forward and backward passes (``loss / k`` when ``scale``), no optimizer."""

    def run() -> None:
        for x, y in data:
            loss = F.mse_loss(model(x), y)
            (loss / K if scale else loss).backward()

    return run


def difference_us(a: Callable[[], None], b: Callable[[], None], rounds: int) -> float:
    """Median over interleaved rounds of (time of a - time of b) / k, in microseconds."""
    diffs = []
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds + 3):
            times = {}
            for name, f in (("a", a), ("b", b)) if r % 2 else (("b", b), ("a", a)):
                start = time.thread_time()
                f()
                times[name] = time.thread_time() - start
            if r >= 3:
                diffs.append((times["a"] - times["b"]) / K * 1e6)
    finally:
        gc.enable()
    return quartiles(diffs)[1]


def passes_then_zero(
    model: nn.Module, opt: torch.optim.Optimizer, data: list[tuple[Tensor, Tensor]]
) -> Callable[[], None]:
    """k plain forward and backward passes, then the optimizer's ``zero_grad()`` (the
    baseline of :func:`window_inside`)."""
    run_passes = passes(model, data, False)

    def run() -> None:
        run_passes()
        opt.zero_grad()

    return run


def window_inside(
    model: nn.Module, opt: Accumulate, data: list[tuple[Tensor, Tensor]]
) -> Callable[[], None]:
    """k micro-steps of accumopt's loop inside one window (it never closes), then a discard."""

    def run() -> None:
        for x, y in data:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.discard()

    return run


def noop(*_: object) -> None:
    """A hook that does nothing."""


HOOK_KINDS = ("pre-hook on the AccumulateGrad node", "tensor hook", "post-accumulate-grad hook")
KEPT: list[object] = []  # the nodes hooked: a node nothing holds is rebuilt without its hook


def hooked(model: nn.Module, kind: str) -> nn.Module:
    """A copy of ``model`` with a no-op hook of ``kind`` (one of :data:`HOOK_KINDS`) on every
    parameter. accumopt's default counting uses the first kind (it runs before the gradient is
    accumulated, so an interrupt in it leaves nothing uncounted)."""
    copied = copy.deepcopy(model)
    for p in copied.parameters():
        if kind == HOOK_KINDS[0]:
            node = torch.autograd.graph.get_gradient_edge(p).node
            node.register_prehook(noop)
            KEPT.append(node)
        elif kind == HOOK_KINDS[1]:
            p.register_hook(noop)  # type: ignore[no-untyped-call]
        else:
            p.register_post_accumulate_grad_hook(noop)  # type: ignore[no-untyped-call]
    return copied


def floor_window(model: nn.Module, data: list[tuple[Tensor, Tensor]]) -> Callable[[], None]:
    """What counting at the parameters needs with no bookkeeping: k plain passes through a copy
    of ``model`` whose ``AccumulateGrad`` pre-hooks queue one end-of-backward callback a pass
    (doing nothing), then the window's one division (``_foreach_div_``, as at a close)."""
    copied = copy.deepcopy(model)
    queue = torch.autograd.Variable._execution_engine.queue_callback
    running = [False]

    def end() -> None:
        running[0] = False

    def begin(*_: object) -> None:
        if not running[0]:
            running[0] = True
            queue(end)

    for p in copied.parameters():
        node = torch.autograd.graph.get_gradient_edge(p).node
        node.register_prehook(begin)
        KEPT.append(node)
    run_passes, divisor = passes(copied, data, False), torch.tensor(float(K))

    def run() -> None:
        run_passes()
        with torch.no_grad():
            torch._foreach_div_([p.grad for p in copied.parameters()], divisor)  # type: ignore[misc]

    return run


def bare_counting(model: nn.Module) -> None:
    """Hook ``model`` the way counting at its outputs does, with callbacks that do nothing."""
    queue = torch.autograd.Variable._execution_engine.queue_callback

    def fire() -> None:
        queue(noop)

    def on_output(_: Tensor) -> None:
        queue(fire)

    def on_forward(_: nn.Module, __: object, output: Tensor) -> None:
        # registered the way accumopt's counter does it (no RemovableHandle)
        output._backward_hooks = OrderedDict(((-1, on_output),))
        output.grad_fn._register_hook_dict(output)

    model.register_forward_hook(on_forward)


def main(argv: list[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []

    small = tiny()
    data = batches(small, 32)
    hand_us = difference_us(passes(small, data, True), passes(small, data, False), args.rounds)
    plain = passes(small, data, False)
    per_pass = difference_us(plain, lambda: None, args.rounds)
    rows.append(["`loss / k` in the hand loop (tiny MLP)", f"{hand_us:.1f} us per micro-step"])
    rows.append(["one tiny-MLP forward and backward pass, for scale", f"{per_pass:.0f} us"])
    floor_us = difference_us(floor_window(small, data), passes(small, data, True), args.rounds)
    rows.append(
        [
            "counting's floor against `loss / k` (tiny MLP): the parameters' pre-hooks, one "
            "end-of-backward callback a pass and one division a window, no bookkeeping",
            f"{floor_us:+.1f} us per micro-step",
        ]
    )

    big = hundred()
    data100 = batches(big, 16)
    for kind in HOOK_KINDS:
        hooks_us = difference_us(
            passes(hooked(big, kind), data100, False), passes(big, data100, False), args.rounds
        )
        rows.append(
            [
                f"a no-op {kind} on each of 100 parameter tensors",
                f"{hooks_us:.1f} us per pass, {hooks_us / 100:.2f} us per tensor",
            ]
        )

    counted0 = copy.deepcopy(small)
    bare_counting(counted0)
    us0 = difference_us(passes(counted0, data, False), plain, args.rounds)
    rows.append(["the bare mechanism of counting at the outputs (tiny MLP)", f"{us0:.1f} us/pass"])

    for name, model_, data_ in (("tiny MLP", small, data), ("100 tensors", big, data100)):
        bare = copy.deepcopy(model_)
        plain_ = passes_then_zero(bare, torch.optim.SGD(bare.parameters(), lr=0.0), data_)
        for given in (False, True):
            counted = copy.deepcopy(model_)
            wrapper = Accumulate(
                torch.optim.SGD(counted.parameters(), lr=0.0),
                every=10**9,
                model=counted if given else None,
            )
            inside = window_inside(counted, wrapper, data_)
            us = difference_us(inside, plain_, args.rounds)
            where = "outputs (`model=`)" if given else "parameters"
            rows.append(
                [f"accumopt inside a window, counting at the {where} ({name})", f"{us:.1f} us/pass"]
            )

    one = nn.Linear(1, 1, bias=False)  # one parameter tensor: what is left is accumopt's own
    data1 = [(torch.randn(1, 1), torch.randn(1, 1)) for _ in range(K)]
    bare1 = copy.deepcopy(one)
    counted1 = copy.deepcopy(one)
    wrapper1 = Accumulate(torch.optim.SGD(counted1.parameters(), lr=0.0), every=10**9)
    us = difference_us(
        window_inside(counted1, wrapper1, data1),
        passes_then_zero(bare1, torch.optim.SGD(bare1.parameters(), lr=0.0), data1),
        args.rounds,
    )
    rows.append(
        [
            "accumopt per micro-step on a one-tensor model (one hook, the end-of-backward "
            "callbacks, `step()`, `zero_grad()`)",
            f"{us:.1f} us",
        ]
    )

    grads = [p.detach().clone() for p in big.parameters()]
    divisor = torch.tensor(8.0)
    m = 2000
    number = timeit.timeit(lambda: torch._foreach_div_(grads, 8.0), number=m) / m * 1e6
    tensor = timeit.timeit(lambda: torch._foreach_div_(grads, divisor), number=m) / m * 1e6
    rows.append(
        [
            "boundary division of 100 CPU gradients",
            f"by a number {number:.0f} us, by a 0-dim tensor {tensor:.0f} us",
        ]
    )
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds, k = {K}\n")
    print(markdown_table(["piece", "cost"], rows))


if __name__ == "__main__":
    main()

"""The wrapper's refusals that depend on its state (a closed window, a paused counter, an AMP
step without a scaler...), and the texts of its read-outs' docstrings.

Every message follows the template of :mod:`accumopt._checks`: what is wrong; expected what;
what to do. Each refusal is decided before any state changes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class _StepState(Protocol):
    """What :func:`step_refusal` reads of the wrapper."""

    scaler: torch.amp.GradScaler | None
    model: torch.nn.Module | None

    @property
    def will_update(self) -> bool: ...

    @property
    def _window(self) -> Any: ...

    @property
    def _counter(self) -> Any: ...

    _drop_at_step: bool


WILL_UPDATE = (
    "True from the end of the backward pass that closes the window until step(): the next "
    "step() applies the update (under AMP, unless the window saw an inf/NaN)."
)
"""The docstring of ``Accumulate.will_update``."""

ITEMS = (
    "Items counted in the open window (float; 0.0 if unweighted). Under DDP/FSDP2: over all "
    "ranks for a window in items; this rank's own for a window in micro-steps until the "
    "boundary, where they are summed over the ranks."
)
"""The docstring of ``Accumulate.items``."""


def check_rollback(buffer: bool | None, fsdp: bool) -> None:
    """Refuse ``enable_rollback()`` where a failed micro-batch cannot be dropped alone."""
    if buffer is False:
        raise RuntimeError(
            "Accumulate.enable_rollback: the wrapper was built with buffer=False; expected "
            "buffer=None or True, so that a failed micro-batch can be dropped alone."
        )
    if fsdp:
        raise RuntimeError(
            "Accumulate.enable_rollback: the gradients of an FSDP2 model are sharded and "
            "reduce-scattered by FSDP2 itself, so a failed micro-batch cannot be dropped "
            "alone; expected a DDP or single-process model for OOM recovery."
        )


def _unscaled(opt: _StepState) -> bool:
    """Whether ``scaler.unscale_(opt)`` ran since the scaler's last ``update()``."""
    from torch.amp.grad_scaler import OptState

    assert opt.scaler is not None
    state = opt.scaler._per_optimizer_states.get(id(opt))
    return state is not None and state["stage"] is OptState.UNSCALED


def items_without_model(world_size: int) -> str:
    """Items under several ranks, but no DDP/FSDP2 model to sum them through."""
    return (
        f"Accumulate: items under a process group of {world_size} ranks, but the wrapper has "
        "no DDP/FSDP2 model, so each rank would divide by its own item count and the replicas "
        "drift apart; expected opt.set_model(ddp_model) (or Accumulate(..., model=ddp_model)) "
        "first. Nothing was changed."
    )


SET_MODEL_IN_WINDOW = (
    "Accumulate.set_model: a window is open, and its micro-steps were counted and synced "
    "for the previous model; expected set_model() between windows (before the first backward "
    "pass, or when opt.micro_step == 0). Call it after the next update, or opt.flush() first."
)

SPARSE_ACROSS_RANKS = (
    "Accumulate: sparse gradients cannot be summed across ranks by accumopt; expected dense "
    "gradients under DistributedDataParallel."
)

NO_ITEMS = (
    "Accumulate.next_items: items=None; expected the number of items (samples, tokens) the "
    "next backward pass covers, a number >= 0 or a one-element tensor."
)


def pending_items(api: str, pending: float) -> str:
    """A second item count before the backward pass of the first."""
    return (
        f"Accumulate.{api}: next_items({pending:g}) is still waiting for its backward pass; "
        "expected one item count per backward pass (next_items(n) then loss.backward(), or "
        "opt.backward(loss_sum, items=n) alone; opt.discard() drops a waiting count with the "
        "window). Nothing was changed by this call."
    )


_PAUSED = {
    "interrupted": (
        "an earlier call into the wrapper was interrupted part-way (an exception such as "
        "KeyboardInterrupt while it updated its state), so the open window cannot be trusted; "
        "expected opt.discard() first (it drops the window and always completes)."
    ),
    "wiped": (
        "the gradients of the open window were cleared or replaced outside the wrapper (see "
        "the error raised then); expected opt.discard() to drop the window first."
    ),
    "unscaled": (
        "scaler.unscale_(opt) ran inside an open window, so .grad holds one micro-batch's "
        "unscaled gradient (clipping it there clips a partial sum, not the window's mean); "
        "expected scaler.unscale_(opt) and clipping only when opt.will_update is True, or "
        "max_grad_norm= on Accumulate. Call opt.discard() to drop the window."
    ),
}


def paused_message(api: str, reason: str = "") -> str:
    """Why ``api`` refuses to go on after a backward pass that died part-way (``reason`` ""),
    ran under compiled autograd (``"compiled"``), a second thread drove the wrapper, the
    window was wiped from outside (``"wiped"``) or unscaled inside (``"unscaled"``)."""
    if reason in _PAUSED:
        return f"Accumulate.{api}: {_PAUSED[reason]} Nothing was changed by this call."
    if reason == "thread":
        return (
            f"Accumulate.{api}: step() was called from a second thread; one wrapper counts the "
            "backward passes of one thread (passes of two threads at once are miscounted), "
            "so it now refuses on every thread; expected one Accumulate per training thread. "
            "The window may hold the other thread's gradients: call opt.discard(), then drive "
            "the wrapper from the thread that first stepped it only. Nothing was changed."
        )
    if reason == "compiled":
        return (
            f"Accumulate.{api}: the last backward pass ran under compiled autograd "
            "(torch._dynamo.compiled_autograd), which runs no autograd engine callbacks, so "
            "accumopt cannot see its end and did not count it; expected compiled autograd off "
            "(torch._dynamo.config.compiled_autograd = False) while training with Accumulate. "
            "Call opt.discard() to drop the window, then run without it. torch.compile of the "
            "model itself is supported. Nothing was changed by this call."
        )
    return (
        f"Accumulate.{api}: an earlier backward pass failed part-way (an OOM, say) and "
        "its partial gradient is still in .grad; expected opt.discard() "
        "(drops the window) or, with the window buffer, opt.drop_micro_step() (drops "
        "that micro-step alone) first. Nothing was changed by this call."
    )


WEIGHTED_IN_APPLY = (
    "Accumulate: a pass of an accumopt.apply call came with an item count (opt.next_items); "
    "expected none: the decorated function returns the micro-batch's mean loss, and a call "
    "is one unweighted micro-step (use every=N), or use MicroBatchRunner for windows in items."
)
"""Raised at the end of a pass of an ``accumopt.apply`` call that was given items."""

DROP_PENDING = (
    "Accumulate: a micro-step with inf/NaN in its gradient (nonfinite='skip_micro_batch') waits "
    "for scaler.step(opt) to drop it (the GradScaler must see the inf to back off its scale); "
    "expected scaler.step(opt) and scaler.update() after every backward pass, before anything "
    "else (PyTorch's gated AMP recipe, scaler.step only at the boundary, cannot drop one "
    "micro-batch: use nonfinite=None or 'skip_window' there), or opt.discard() to drop the "
    "window."
)
"""Why the wrapper takes no backward pass, flush or checkpoint while a dropped micro-step waits
for its ``scaler.step``."""


UNREFUSABLE = (
    "This backward pass did not go through opt.backward(), so it could not be refused before "
    "its gradient was added to .grad: call opt.discard() to drop the window, then fix the loop."
)
"""Appended to a window's refusal raised at the end of a plain ``loss.backward()``."""


def nonfinite_message(micro_step: int) -> str:
    """``nonfinite="raise"``: micro-step ``micro_step`` of the window was dropped."""
    return (
        f"Accumulate: the gradient of micro-step {micro_step} of the open window holds an inf "
        "or NaN; it was dropped and the window is intact. Check that micro-batch's inputs and "
        "loss, or use nonfinite='skip_micro_batch'."
    )


def inseparable_message(closed: bool) -> str:
    """Why ``drop_micro_step()`` cannot drop the micro-step in flight alone."""
    if closed:
        return (
            "Accumulate.drop_micro_step: the window is complete and its gradient formed; "
            "expected a micro-step whose backward pass failed or is not yet counted. Call "
            "opt.discard() to drop the whole window."
        )
    return (
        "Accumulate.drop_micro_step: finished micro-steps of the open window are mixed with "
        "the one in flight (in .grad, or, for bf16/fp16 parameters, in the window buffer "
        "as autograd produced it), so it cannot be dropped alone; expected buffer=True (or "
        "opt.enable_rollback() before the window) and, under a GradScaler, "
        "scaler.step(opt) after every backward pass."
    )


def step_refusal(amp: bool, scaled: bool, opt: _StepState) -> Exception | None:
    """Why ``opt.step()`` must not go on, as the exception to raise, or None.

    Args:
        amp: ``step`` was called through ``GradScaler.step``.
        scaled: a ``GradScaler`` is in use and the gradients are scaled (not a closed window
            that a ``scaler.step`` which raised after unscaling it left: ``opt.step()`` may
            retry that one).
        opt: the wrapper.
    """
    if amp and scaled and not opt.will_update and _unscaled(opt):
        opt._counter.pause("unscaled")  # .grad holds an unscaled micro-step: the window is lost
    if opt._counter.paused:
        return RuntimeError(paused_message("step", opt._counter.paused_reason))
    if opt._drop_at_step and not amp:  # the scaler must see the inf to back off its scale
        return RuntimeError(f"{DROP_PENDING} step() changed nothing.")
    if amp and opt.scaler is None:  # not adopted: a micro-step was folded without a scale
        return RuntimeError(
            "Accumulate.step: called through GradScaler.step, but the wrapper was built "
            "without scaler= and micro-steps of this window were already summed without a "
            "loss scale; expected Accumulate(optimizer, ..., scaler=scaler), or scaler.step(opt) "
            "from the first micro-step on. Call opt.discard() to drop the window."
        )
    if opt._window.stepped:
        hint = (
            "Check that the loss depends on the wrapped parameters; parameters that were "
            "frozen when the wrapper was built are counted from the next real zero_grad() on."
        )
        if opt._counter.retired:
            hint = (
                "This wrapper counts no backward pass any more: Lightning's AccumulateCallback "
                "released it at the end of a fit; return it from configure_optimizers to fit "
                "with it again, or build a new Accumulate."
            )
        elif opt.model is not None:
            hint += (
                f" With model= a backward pass is counted when it reaches a tensor returned "
                f"by the {type(opt.model).__qualname__} given (in a tuple, list or dict): "
                "check that the loss is computed from model(...)'s outputs, or use "
                "opt.backward(loss) for other losses."
            )
            if type(opt.model).__name__ != "OptimizedModule":  # not torch.compile's module
                hint += (
                    " If the model runs through torch.compile, give the compiled module as "
                    "model=: code Dynamo compiled before the wrapper hooked the module runs "
                    "without its hook (Dynamo does not guard on hooks)."
                )
        return RuntimeError(
            "Accumulate.step: no backward pass since the last step(); expected one "
            "backward pass (loss.backward() or opt.backward(loss, items=n)) before each "
            f"step(). ({hint})"
        )
    if opt.will_update and not amp and scaled:
        return RuntimeError(
            "Accumulate.step: the window is complete but step() was not called through "
            "the GradScaler given as scaler=, so the gradients are still scaled; expected "
            "scaler.step(opt) followed by scaler.update()."
        )
    return None


WHERE = (
    "counting micro-step {m} of a window in items",
    "closing a window at micro-step {m}",
    "flush() with {m} micro-step(s) pending",
    "at the forward of the micro-step after {m}, which closes the window",
    "scaler.step after micro-step {m}",
    "agreeing on a micro-batch's out-of-memory failure",
    "checking the rows of the runner's batch",
)
"""The positions ``accumopt.distributed`` stamps on its small collectives, in the order of its
``_ITEMS, _CLOSE, ...`` codes; a stamp is ``micro_step * len(WHERE) + position``."""


def _describe(code: float) -> str:
    return WHERE[int(code) % len(WHERE)].format(m=int(code) // len(WHERE))


def not_joined(code: float, err: BaseException) -> str:
    """A collective at position ``code`` that not every rank joined in time."""
    return (
        f"Accumulate: this rank was {_describe(code)}; not every rank joined in time "
        f"({str(err)[:200]}); expected the same micro-steps per window on every rank "
        "and flush() on every rank together."
    )


def ranks_apart(codes: list[float]) -> str:
    """Ranks that met at different positions (``codes`` in rank order)."""
    seen = "; ".join(f"rank {i}: {_describe(c)}" for i, c in enumerate(codes))
    return (
        f"Accumulate: the ranks are at different points of the accumulation window ({seen}); "
        "expected every rank to run the same number of micro-steps per window and to call "
        "flush() on every rank together. Nothing of this window was applied; call "
        "opt.discard() on every rank (or stop)."
    )

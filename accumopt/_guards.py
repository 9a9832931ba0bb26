"""What code outside the wrapper must not change inside an open window, and how it is caught.

A window's micro-steps add up in ``.grad`` (in place: the tensor stays the same object, its
version counter grows by one per accumulating backward pass) and are applied at the boundary
with the learning rate the window was opened under. Code that does not know about the window
breaks that silently: ``model.zero_grad()`` or a framework's own zeroing after every micro-step,
``p.grad = None``, ``p.grad.zero_()``, an LR scheduler stepped every micro-step, the inner
optimizer stepped directly, a second live wrapper. :class:`WindowGuard` notes the state after
a window's first micro-step (or a loaded window) and checks it once, at its close.

What it cannot see: a gradient zeroed in place where some micro-step did not reach it (its
version counter is within the allowance), a sparse gradient set to None whose later micro-steps
reached every row the first one did, an LR held in a tensor and changed in place. Under DDP with
``gradient_as_bucket_view=True`` and FSDP2 ``.grad`` changes legitimately: only the learning
rate is checked there. Under a GradScaler, ``scaler.step`` inside the window folds the
micro-steps in ``.grad`` out of it: they are checked before that fold too, and noted afresh at
the next micro-step."""

from __future__ import annotations

import sys
import weakref
from itertools import compress, repeat
from operator import attrgetter, is_not, sub
from types import MethodType
from typing import TYPE_CHECKING, Any

from torch import Tensor

from accumopt._grads import holds_indices

if TYPE_CHECKING:
    from accumopt.accumulate import AccumulatingOptimizer

WIPED = (
    "Accumulate: the gradients of the open window were replaced or cleared by code outside "
    "the wrapper ({what}; {count} parameter(s), e.g. one of shape {shape}) between its first "
    "micro-step and now: model.zero_grad(), the inner optimizer's zero_grad(), p.grad = None "
    "or p.grad.zero_() every micro-step, a framework's own zeroing, or another live Accumulate "
    "over these parameters (each divides at its own close). The window's sum is lost, so it was "
    "not applied; expected gradients cleared only through opt.zero_grad() (a no-op inside a "
    "window). Call opt.discard() to drop the window, then remove that call (accumopt.integrations "
    "adapts Trainer, Lightning and Accelerate)."
)

LR_CHANGED = (
    "Accumulate: the learning rate of param group {group} changed inside the open window "
    "(from {before!r} to {after!r}); a scheduler stepped every micro-step counts micro-steps, "
    "not updates. Nothing was applied; expected scheduler.step() only after a real update "
    "(if opt.did_update: scheduler.step()). Set the learning rate back and call step() again, "
    "or call opt.discard() to drop the window."
)

SCHEDULER_INSIDE = (
    "Accumulate: the LR scheduler {name} was stepped inside the open window (last_epoch from "
    "{mark} at its first micro-step to {now}); expected scheduler.step() only after a real "
    "update (if opt.did_update: scheduler.step()), or at an epoch end after opt.flush(). "
    "Stepped every micro-step, it counts micro-steps, not updates, and its schedule runs ahead "
    "even where its learning rate does not change inside a window. Nothing was applied. Restore "
    "the scheduler's state (scheduler.load_state_dict) and call opt.discard() to drop this "
    "window."
)

STEPPED_DIRECTLY = (
    "Accumulate: the inner {name} was stepped directly, not through the wrapper, while the "
    "wrapper accumulates its gradients (the update would use a partial window). It was not "
    "stepped; expected opt.step() on the Accumulate wrapper only (it steps the inner optimizer "
    "at the accumulation boundary), or drop the wrapper (del opt) to step the inner optimizer "
    "yourself."
)


class WindowGuard:
    """The window's ``.grad`` tensors and learning rates as its first micro-step left them
    (the ``.grad`` tensors: under AMP, as the first micro-step since the last fold left them).

    Attributes:
        params: the parameters whose window lives in ``.grad`` (dense, with a gradient), or
            None when nothing is noted (no open window of two micro-steps or more, the window
            buffer or FSDP2 holds the window, ``scaler.step`` just folded it).
        grads: their ``.grad`` tensors. versions: the version counters of every
            ``stride``-th of them.
        lrs: each param group's ``"lr"``, or None.
    """

    def __init__(self) -> None:
        self.params: list[Tensor] | None = None
        self.grads: list[Tensor] = []
        self.versions: list[int] = []
        self.stride = 1
        self.lrs: list[Any] | None = None
        self.micro_step = 0  # the window's micro-steps when they were noted
        self.absorbed = 0  # passes since, part of a micro-step of several (accumopt.apply)
        # LR schedulers stepping the wrapper (weakly), their last_epoch when noted (or None)
        self.schedulers: list[tuple[weakref.ref[Any], int | None]] = []
        self.step_called = False  # torch's LRScheduler handshake (see scheduler_handshake)

    def forget(self) -> None:
        """A new window opened, or a checkpoint was loaded: nothing to compare with, and no
        reference kept to the window's gradients (they must be freed with the window)."""
        self.params = self.lrs = None
        self.grads = []
        self.schedulers = [(ref, None) for ref, _ in self.schedulers if ref() is not None]

    def forget_grads(self) -> None:
        """The window left ``.grad`` (folded): no ``.grad`` tensor to compare with (the
        learning rates stay noted)."""
        self.params, self.grads = None, []

    def note(
        self, groups: list[dict[str, Any]], in_grad: list[Tensor] | None, micro_step: int
    ) -> None:
        """Note the state after the window's first micro-step.

        Args:
            groups: the param groups (their ``"lr"`` is noted).
            in_grad: the parameters whose window lives in ``.grad``; None: do not note
                gradients (FSDP2, DDP's bucket views).
            micro_step: the window's micro-steps so far (1).
        """
        self.lrs = [g.get("lr") for g in groups]
        self.schedulers = [(ref, getattr(ref(), "last_epoch", None)) for ref, _ in self.schedulers]
        self.note_grads(in_grad, micro_step)

    def note_grads(self, in_grad: list[Tensor] | None, micro_step: int) -> None:
        """Note the ``.grad`` tensors of ``in_grad`` after the window's ``micro_step``-th
        micro-step (the first one, or under AMP the first one since ``scaler.step`` folded
        the window out of ``.grad``)."""
        self.micro_step, self.absorbed = micro_step, 0
        if in_grad is None:
            self.params = None
            return
        # C-level maps, once per window: every gradient's identity, the version counters of
        # an evenly spaced sample of at most _SAMPLE (zeroing in place hits every parameter)
        grads = list(map(_GRAD, in_grad))
        if all(map(is_not, grads, repeat(None))):  # the usual case: every parameter reached
            self.params, self.grads = in_grad, grads
        else:
            held = list(map(is_not, grads, repeat(None)))
            self.params = list(compress(in_grad, held))
            self.grads = list(compress(grads, held))
        self.stride = max(1, len(self.grads) // _SAMPLE)
        self.versions = list(map(_VERSION, self.grads[:: self.stride]))

    def wiped(self, micro_step: int, extra_writes: int, now: list[Tensor | None]) -> str | None:
        """Why the window's gradients cannot be trusted at its close, or None.

        Args:
            micro_step: the window's micro-steps now.
            extra_writes: in-place writes into ``.grad`` that are not accumulation (1 where
                DDP's reducer copies the closing pass's all-reduced buckets back).
            now: the ``.grad`` of :attr:`params` now.
        """
        if not self.params:
            return None
        passes = micro_step - self.micro_step + extra_writes + self.absorbed  # since the note
        if not any(map(is_not, now, self.grads)):
            grown = map(sub, map(_VERSION, now[:: self.stride]), self.versions)
            if max(grown) <= passes:
                return None
        versions = dict(zip(range(0, len(now), self.stride), self.versions))
        bad = [
            (p, what)
            for i, (p, g, noted) in enumerate(zip(self.params, now, self.grads))
            if (what := _change(g, noted, versions.get(i), passes)) is not None
        ]
        if not bad:
            return None
        return WIPED.format(what=bad[0][1], count=len(bad), shape=tuple(bad[0][0].shape))

    def scheduler_stepped(self) -> str | None:
        """Why the window must not be applied because a scheduler stepped inside it, or None."""
        for ref, mark in self.schedulers:
            now = getattr(ref(), "last_epoch", None)
            if mark is not None and now != mark:
                name = type(ref()).__name__
                return SCHEDULER_INSIDE.format(name=name, mark=mark, now=now)
        return None

    def lr_changed(self, groups: list[dict[str, Any]]) -> str | None:
        """Why the window must not be applied with the groups' learning rates, or None."""
        if self.lrs is None:
            return None
        for i, (group, before) in enumerate(zip(groups, self.lrs)):
            after = group.get("lr")
            if after is not before and not (isinstance(after, float) and after == before):
                return LR_CHANGED.format(group=i, before=before, after=after)
        return None


_SAMPLE = 32
_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")


def _change(now: Tensor | None, noted: Tensor, version: int | None, passes: int) -> str | None:
    """How a parameter's ``.grad`` changed other than by accumulation, or None (``version``:
    None where the parameter is not in the version sample)."""
    if now is None:
        return "set to None"
    if now is not noted:
        # accumulation itself replaces a sum under create_graph=True (the new sum has a
        # history; a sparse one need not, but it keeps every index of the noted one)
        accumulated = now.grad_fn is not None or (noted.is_sparse and holds_indices(now, noted))
        return None if accumulated else "replaced by another tensor"
    if version is not None and now._version > version + passes:
        return "changed in place: zeroed, or clipped inside the window"
    return None


def _in_grad(opt: AccumulatingOptimizer) -> list[Tensor] | None:
    """The parameters whose window lives in ``.grad`` between micro-steps, or None where the
    closing pass replaces ``.grad`` itself."""
    sync, buffer = opt._sync, opt._buffer
    module = getattr(sync, "module", None)
    if sync.fsdp or getattr(module, "gradient_as_bucket_view", False):
        return None
    params = opt._window_params()
    if buffer.unfolded:  # AMP: every micro-step waits in .grad for scaler.step, buffered too
        return params
    buffered = {id(p) for p in buffer.buffered_params(params)}
    return [p for p in params if id(p) not in buffered] if buffered else params


def note(opt: AccumulatingOptimizer) -> None:
    """The window's first micro-step was counted and did not close it: note its state."""
    opt._guard.note(opt.param_groups, _in_grad(opt), opt._window.micro_step)


def note_grads(opt: AccumulatingOptimizer) -> None:
    """Note the ``.grad`` tensors of the open window now (the learning rates stay as noted):
    under AMP after the first micro-step since ``scaler.step`` folded the window out of
    ``.grad``; in a copy of the wrapper (``copy.deepcopy``, pickling)."""
    opt._guard.note_grads(_in_grad(opt), opt._window.micro_step)


def scaler_step(
    opt: AccumulatingOptimizer, params: list[Tensor], scale: Tensor | None, found_inf: Tensor
) -> None:
    """``scaler.step(opt)`` (``WindowBuffer.scaler_step``). Inside the window it folds the
    micro-steps in ``.grad`` out of it: they are checked for a wipe first, as at the close,
    and noted afresh at the next micro-step (:func:`note_grads`)."""
    closed = opt._window.closed
    if not closed:
        check_close(opt, params)
    opt._buffer.scaler_step(params, scale, found_inf, closed)
    if not closed:
        opt._guard.forget_grads()


def check_close(opt: AccumulatingOptimizer, params: list[Tensor]) -> list[Tensor | None] | None:
    """Before the window's gradient is formed (or folded: :func:`scaler_step`): refuse a
    window whose ``.grad`` was wiped, and pause counting until ``discard()`` (the window's sum
    is lost). Returns the ``.grad`` of ``params`` as read for the check (aligned with them), or
    None where it read none."""
    guard = opt._guard
    if not guard.params:  # nothing noted (a window of one micro-step): nothing to check
        return None
    now = list(map(_GRAD, guard.params))
    micro_step = opt._window.micro_step
    writes = opt._sync.grad_writes(micro_step)  # with a sync, an absorbed pass may write back
    problem = guard.wiped(micro_step, writes + guard.absorbed if writes else 0, now)
    if problem is not None:
        opt._counter.pause("wiped")
        raise RuntimeError(problem)
    return now if guard.params is params else None


def check_lr(opt: AccumulatingOptimizer) -> None:
    """Before the inner step: refuse a learning rate changed inside the window, or a scheduler
    stepped inside it (the window stays closed and intact; a retried ``step()`` checks
    again)."""
    problem = opt._guard.lr_changed(opt.param_groups) or opt._guard.scheduler_stepped()
    if problem is not None:
        raise RuntimeError(problem)


def _handshake_get(opt: AccumulatingOptimizer) -> bool:
    """``opt._opt_called``, read by torch's ``LRScheduler.step`` on its first call after
    construction (to warn about a scheduler stepped before the optimizer): the scheduler
    calling is recorded (weakly), its ``last_epoch`` noted with the window's state after each
    window's first micro-step, so that :func:`check_lr` can tell a scheduler stepped inside a
    window even when its learning rate does not change there (``StepLR`` stepped every
    micro-step with a step size that is a multiple of the window). Stepping between windows
    (after an update, as often as the caller likes: Accelerate steps once per process) is
    not looked at."""
    guard = opt.__dict__.get("_guard")
    frame = sys._getframe(1)
    torch_step = frame.f_code.co_name == "step" and _torch_optim(frame)
    owner = frame.f_locals.get("self") if torch_step else None  # torch's frame only
    if guard is not None and getattr(owner, "optimizer", None) is opt:
        epoch = getattr(owner, "last_epoch", None)
        known = [i for i, (ref, _) in enumerate(guard.schedulers) if ref() is owner]
        mark = epoch if isinstance(epoch, int) and guard.lrs is not None else None
        if not known:  # noted now if a window is open (this step() has not counted yet)
            guard.schedulers.append((weakref.ref(owner), mark))
        elif guard.schedulers[known[0]][1] is None:
            guard.schedulers[known[0]] = (guard.schedulers[known[0]][0], mark)
    return bool(guard is not None and guard.step_called)


def _handshake_set(opt: AccumulatingOptimizer, value: bool) -> None:
    """``opt._opt_called = True``: set by the step wrapper a scheduler puts on ``opt``."""
    guard = opt.__dict__.get("_guard")
    if guard is not None:
        guard.step_called = bool(value)


scheduler_handshake = property(_handshake_get, _handshake_set)


def _torch_optim(frame: Any) -> bool:
    """Whether ``frame`` runs torch.optim's code (whose ``f_locals`` may be read: reading a
    user frame's would keep its objects alive before Python 3.13)."""
    return bool(frame.f_globals.get("__name__", "").startswith("torch.optim"))


def _register(guard: WindowGuard, scheduler: object) -> None:
    """Watch ``scheduler`` (weakly) from the next window's first micro-step on."""
    if not any(ref() is scheduler for ref, _ in guard.schedulers):
        guard.schedulers.append((weakref.ref(scheduler), None))


class StepSlot:
    """The wrapper's ``step``: a method that records who replaces it.

    torch's ``LRScheduler`` constructor replaces ``optimizer.step`` on the instance with a
    wrapper of its own (``opt.step = wrap(opt.step)``, once per optimizer): assigning over
    ``step`` is recorded with the scheduler doing it (found on torch's own frames), so that a
    scheduler whose state is loaded afterwards (``_step_count > 1``: torch's first-step
    handshake, :func:`_handshake_get`, never runs for it) is watched too. Reading ``step``
    gives what was assigned, or the bound method.
    """

    hooked = True  # torch's Optimizer._patch_step_function leaves the method unwrapped

    def __init__(self, function: Any) -> None:
        self.function = function
        self.__doc__, self.__name__ = function.__doc__, function.__name__
        self.__qualname__, self.__wrapped__ = function.__qualname__, function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # Accumulate.step(opt, ...)
        return self.function(*args, **kwargs)

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        replaced = obj.__dict__.get("_step_replaced")
        return replaced if replaced is not None else MethodType(self.function, obj)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__["_step_replaced"] = value
        guard = obj.__dict__.get("_guard")
        frame = sys._getframe(1) if guard is not None else None
        for _ in range(4):  # torch's frames only (reading f_locals keeps a frame's objects)
            if frame is None:
                return
            if _torch_optim(frame):
                owner = frame.f_locals.get("self")
                if getattr(owner, "optimizer", None) is obj and hasattr(owner, "last_epoch"):
                    _register(guard, owner)
                    return
            frame = frame.f_back

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop("_step_replaced", None)

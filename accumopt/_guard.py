"""What code outside the wrapper must not change inside an open window, and how it is caught: a
window adds up in ``.grad`` in place (version counters one higher per accumulating pass) under
the learning rate it opened with. :class:`Guard` notes both after the first micro-step, checks
one sentinel gradient every micro-step (O(1)), and every gradient and rate at the close."""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_not, sub
from typing import Any

from torch import Tensor

from accumopt._grads import holds_indices

_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")

WIPED = (
    "Accumulate: the gradients of the open window were replaced or cleared by code outside the "
    "wrapper ({what}; {count} parameter(s), e.g. one of shape {shape}): model.zero_grad(), "
    "p.grad = None, a framework's own zeroing, or another live Accumulate over these parameters. "
    "Clear gradients only through opt.zero_grad() (a no-op inside a window), or opt.discard()."
)
LR_CHANGED = (
    "Accumulate: the learning rate of param group {group} changed inside the open window (from "
    "{before!r} to {after!r}); nothing was applied. Step the scheduler only if opt.did_update; "
    "set the rate back and step() again, or opt.discard()."
)


class Guard:
    """The window's ``.grad`` tensors and learning rates as its first micro-step left them:
    ``params`` (whose window lives in ``.grad``; None: nothing noted), their ``grads``, the
    ``versions`` of every ``stride``-th, each group's ``lrs`` (a tensor rate with its version and
    a copy of its value: schedulers change one in place), and the ``passes`` (writes into
    ``.grad``) expected since: one per accumulating pass, one more per pass DDP synchronised."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """A window opened or was loaded: nothing to compare with."""
        self.lrs: list[Any] | None = None
        self._lr_copies: dict[int, tuple[int, Tensor]] = {}
        self.forget_grads()

    def forget_grads(self) -> None:
        """The window left ``.grad`` (folded): only the learning rates stay noted."""
        self.params: list[Tensor] | None = None
        self.grads: list[Tensor] = []
        self.passes = 0
        self._sentinel: tuple[Tensor, Tensor, int] | None = None

    def note(self, groups: list[dict[str, Any]], in_grad: list[Tensor] | None) -> None:
        """Note the learning rates and (:meth:`note_grads`) the gradients."""
        self.lrs = [g.get("lr") for g in groups]
        self._lr_copies = {
            i: (lr._version, lr.detach().clone())  # on its device: no host sync
            for i, lr in enumerate(self.lrs)
            if isinstance(lr, Tensor)
        }
        self.note_grads(in_grad)

    def note_grads(self, in_grad: list[Tensor] | None) -> None:
        """Note the ``.grad`` tensors of ``in_grad`` (the parameters whose window lives in
        ``.grad``, or None): each one's identity, the versions of 32 to 63 of them."""
        self.forget_grads()
        if in_grad is None:
            return
        grads = list(map(_GRAD, in_grad))
        held = list(map(is_not, grads, repeat(None)))
        if not all(held):
            in_grad, grads = list(compress(in_grad, held)), list(compress(grads, held))
        self.params, self.grads = in_grad, grads
        self.stride = max(1, len(grads) // 32)
        self.versions: list[int] = list(map(_VERSION, grads[:: self.stride]))
        if grads and not grads[0].is_sparse:
            self._sentinel = (in_grad[0], grads[0], grads[0]._version)

    def passed(self, writes: int = 1) -> str | None:
        """A pass wrote ``writes`` times into ``.grad``: :meth:`wiped` if the sentinel changed."""
        self.passes += writes
        if self._sentinel is None:
            return None
        param, grad, version = self._sentinel
        changed = param.grad is not grad or grad._version > version + self.passes
        return self.wiped() if changed else None

    def wiped(self) -> str | None:
        """Why the window's gradients cannot be trusted (checked once, at its close), or None."""
        if not self.params:
            return None
        now = list(map(_GRAD, self.params))
        grown = map(sub, map(_VERSION, now[:: self.stride]), self.versions)  # lazy
        if not any(map(is_not, now, self.grads)) and max(grown) <= self.passes:
            return None
        versions = dict(zip(range(0, len(now), self.stride), self.versions))
        bad = [
            (p, what)
            for i, (p, g, noted) in enumerate(zip(self.params, now, self.grads))
            if (what := _change(g, noted, versions.get(i), self.passes)) is not None
        ]
        if not bad:
            return None
        return WIPED.format(what=bad[0][1], count=len(bad), shape=tuple(bad[0][0].shape))

    def lr_changed(self, groups: list[dict[str, Any]]) -> str | None:
        """Why the window must not be applied with the groups' learning rates, or None."""
        for i, (group, before) in enumerate(zip(groups, self.lrs or [])):
            after, copy = group.get("lr"), self._lr_copies.get(i)
            if copy is not None:  # a tensor rate: its values are read only if its version moved
                if after is before and after._version == copy[0]:
                    continue
                before = copy[1]
            elif after is before:
                continue
            if _value(after) != _value(before):
                return LR_CHANGED.format(group=i, before=_value(before), after=_value(after))
        return None

    def close_lrs(self, groups: list[dict[str, Any]]) -> None:
        """The window closed: a rate changed while it was open stays refused at ``step()``; else
        a rate set from now on is the update's own (a hand loop sets it before its step)."""
        if self.lr_changed(groups) is None:
            self.lrs, self._lr_copies = None, {}


def _value(rate: Any) -> Any:
    """A learning rate as a number (a one-element tensor read on the host)."""
    return rate.item() if isinstance(rate, Tensor) and rate.numel() == 1 else rate


def _change(now: Tensor | None, noted: Tensor, version: int | None, passes: int) -> str | None:
    """How a parameter's ``.grad`` changed other than by accumulation, or None."""
    if now is None:
        return "set to None"
    if now is not noted:
        # accumulation replaces a sum with a history (create_graph=True), or a sparse one
        accumulated = now.grad_fn is not None or (noted.is_sparse and holds_indices(now, noted))
        return None if accumulated else "replaced by another tensor"
    if version is not None and now._version > version + passes:
        return "changed in place: zeroed, or clipped inside the window"
    return None

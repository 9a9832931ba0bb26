"""Gradient accumulation as an optimizer wrapper: ``Accumulate(optimizer, every=N)``.

The window lives in one record (``_state.State``). A call changing several of its fields sets
the phase to BROKEN first and the final phase last: an exception or interrupt in between leaves
a wrapper refusing all but ``discard()`` and ``load_state_dict()``, never a half-changed one."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from threading import get_ident
from typing import Any, cast

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils.hooks import RemovableHandle

from accumopt import _checkpoint, _checks, _grads
from accumopt._buffer import WindowBuffer
from accumopt._checks import framework_accumulating
from accumopt._counting import COMPILED_AUTOGRAD, GROUP, PENDING, Counter, distributed
from accumopt._guard import Guard
from accumopt._state import Phase, Rules, SizeFn, State, Window
from accumopt.distributed import GradSync, LocalSync, is_distributed, sync_for

_LOG = logging.getLogger("accumopt")
_Hooks = OrderedDict[int, Callable[..., None]]
OPEN, PASS, HELD = Phase.OPEN, Phase.PASS, Phase.HELD
CLOSED, APPLY, BROKEN = Phase.CLOSED, Phase.APPLY, Phase.BROKEN

UNREFUSABLE = (
    "This backward pass did not go through opt.backward(), so it could only be refused after "
    "its gradient reached .grad: call opt.discard(), then fix the loop."
)
_FAILED = "an earlier call into the wrapper failed part-way ({})"
_COUNTING = _FAILED.format("counting a micro-step")
_FOLDING = _FAILED.format("scaler.step(opt) inside the window")
_APPLYING = _FAILED.format("step() applying the window")
_FLUSHING = _FAILED.format("flush() closing the window")
_DISCARDING = _FAILED.format("discard()")
_ROUTING = _FAILED.format("enable_rollback()")
_IN_HOOK = "a micro-step hook is running (hooks read the wrapper; they do not call into it)"
_WIPED = "the window's .grad was cleared or replaced outside the wrapper (see the error then)"
STEPPED_DIRECTLY = (
    "Accumulate: the inner {name} was stepped directly inside the wrapper's window; it was not "
    "stepped. Call opt.step() on the wrapper, or drop the wrapper (del opt) to step the "
    "optimizer yourself."
)
_GROUP_ITEMS = (
    "Accumulate: a pass of an accumopt.MicroStepGroup (accumopt.apply) came with an item count; "
    "expected mean losses there (one unweighted micro-step)."
)
_NOT_OPEN = {
    CLOSED: "Accumulate: a backward pass ran after the window closed and before step(); "
    "expected step() after the pass that closes the window.",
    HELD: "Accumulate: a backward pass ran while a micro-step waited for opt.commit().",
}


class Accumulate(torch.optim.Optimizer):
    """Wrap any ``torch.optim.Optimizer`` so that it steps once per window of micro-batches.

    Each backward pass into a wrapped parameter is one micro-step; the loop stays as it was
    (docs/guide/loop.md).

    Args:
        optimizer: any ``torch.optim.Optimizer`` but LBFGS; its ``param_groups``, ``state`` and
            ``defaults`` are shared (schedulers, clipping and checkpoints work unchanged).
        every: micro-steps per update (int >= 1), or ``every_items``: items per update (> 0);
            either may be a schedule ``f(updates, items_seen) -> size`` (:mod:`accumopt.schedules`).
        reduction: ``"mean"`` (default: the mean over micro-steps; with items, the summed loss
            over the window's items) or ``"sum"`` (summed gradients).
        max_grad_norm: clip the window's unscaled gradient to this 2-norm before the step
            (``inf``: measure only, :attr:`last_window`); may be set between steps.
        scaler: the ``GradScaler`` of a loop that calls ``scaler.step(opt)`` every micro-step
            (each is unscaled with its own scale); not needed at the boundary only (AMP recipe).
        buffer: None (default): finished micro-steps of bf16/fp16 parameters summed in float32;
            True: of every parameter (a failed micro-batch can be dropped alone); False: never.
        nonfinite: None (unchecked) or ``"skip_window"``: a window with an inf/NaN gradient is
            dropped without an update (one host sync per window).
        model: the model the losses come from (passes are counted at its outputs); with DDP or
            FSDP2, one gradient sync per update and items summed over the ranks.
        reduce_every_micro_step: synchronise every micro-step, not only the closing one.
        noise_scale: True or a :class:`accumopt.noise.NoiseScale`: estimate the noise scale.

    Attributes:
        optimizer: the inner optimizer. last_window (:class:`~accumopt._state.Window` | None):
            the last boundary. noise_scale: the estimator, or None. driven_by (str | None): the
            framework cutting the windows (set by integrations; None: framework accumulation is
            refused, docs/frameworks/).

    Raises:
        TypeError: ``optimizer`` not an optimizer, already wrapped, or LBFGS; ``scaler`` not a
            ``GradScaler``; ``model`` not an ``nn.Module``; a flag not a bool.
        ValueError: a setting out of range, or a combination accumopt cannot honour exactly."""

    _step_supports_amp_scaling = True  # GradScaler.step hands us grad_scale and found_inf
    _accumopt_wrapper = True
    model: torch.nn.Module | None
    _counter: Counter  # set by _bind()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        every: int | SizeFn | None = None,
        *,
        every_items: float | SizeFn | None = None,
        reduction: str = "mean",
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        buffer: bool | None = None,
        nonfinite: str | None = None,
        model: torch.nn.Module | None = None,
        reduce_every_micro_step: bool = False,
        noise_scale: Any = False,
    ) -> None:
        inner = _checks.check_optimizer(optimizer)
        every, every_items = _checks.check_window(every, every_items)
        self.reduction = _checks.check_reduction(reduction)
        self.max_grad_norm = max_grad_norm
        self.scaler = _checks.check_scaler(scaler)
        self.buffer = _checks.check_buffer(buffer)
        self.nonfinite = _checks.check_nonfinite(nonfinite)
        flag = _checks.check_flag(reduce_every_micro_step, "reduce_every_micro_step")
        self.reduce_every_micro_step = flag
        # Base init on copies of the groups, then share the inner's containers by identity
        super().__init__([dict(g) for g in inner.param_groups], inner.defaults)
        self.optimizer, self.param_groups = inner, inner.param_groups
        self.state, self.defaults = inner.state, inner.defaults
        self._rules = Rules(every, every_items, self.reduction)
        self._state = State()
        self._buffer = WindowBuffer(self.buffer, self.buffer is True, self.scaler)
        self._guard = Guard()
        self._micro_step_hooks, self._window_hooks = _Hooks(), _Hooks()
        self._update_hooks = _Hooks()
        self.last_window: Window | None = None
        self.driven_by: str | None = None
        self._thread: int | None = None  # the thread that steps the wrapper
        self._passes, self._hold = 0, False  # passes seen to end; in opt.backward(hold=True)
        self._held: float | Tensor | None = None  # the items of a HELD micro-step
        self._last_found: Tensor | None = None  # AMP: the closing pass's own inf/NaN flag
        self._gated = False  # a GradScaler stepped a boundary without scaler=
        self._listed: list[Tensor] | None = None
        self._dtypes: tuple[Any, ...] = ()
        self.model, self._sync = None, LocalSync()
        self._bind(model, "outputs")
        self.noise_scale = _attach_noise(self, noise_scale)
        _checks.claim(inner, self)
        _watch_inner(inner, self)
        weakref.finalize(self, _warn_unapplied, self._state)
        self._open()  # the first window's size (a schedule may refuse it)

    @property
    def every(self) -> int | None:
        """The open window's size in micro-steps (int), or None for a window in items (a
        schedule that has given no valid size is asked first; None if it still gives none)."""
        size = self._size()
        return None if self._rules.in_items or size is None else int(size)

    @property
    def every_items(self) -> float | None:
        """The open window's size in items (asked as :attr:`every`), or None (in micro-steps)."""
        return self._size() if self._rules.in_items else None

    def _size(self) -> float | None:
        if self._state.size is None and self._state.phase is OPEN:
            self._rules.sized(self._state)
        return self._state.size

    @property
    def max_grad_norm(self) -> float | None:
        """The 2-norm the window's gradient is clipped to (None: no clipping; ``inf``: measured
        only); may be set between steps. ValueError: not None, > 0 or ``inf``."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._max_grad_norm = _checks.check_max_grad_norm(value)

    micro_step = property(lambda self: self._state.micro_step, doc="Micro-steps in the window.")
    items = property(
        lambda self: self._state.items,
        doc="Items counted in the open window (float; 0.0 if unweighted). Under DDP/FSDP2: "
        "over all ranks for a window in items, else this rank's own until the boundary.",
    )
    will_update = property(
        lambda self: self._state.phase is CLOSED,
        doc="True from the closing pass until step(), which updates (under AMP: unless inf/NaN).",
    )
    updates = property(lambda self: self._state.updates, doc="Inner steps applied so far.")
    did_update = property(
        lambda self: self._state.did_update,
        doc="Whether the last step() or flush() applied an update (reset at the next micro-step).",
    )
    weighted = property(
        lambda self: self._state.weighted, doc="Whether micro-steps carry items (None: none yet)."
    )
    phase = property(lambda self: self._state.phase, doc="The window's phase (_state.Phase).")
    world_size = property(lambda self: self._sync.world_size, doc="DDP/FSDP2 ranks (1 without).")
    rank = property(lambda self: self._sync.rank, doc="This process's rank (0 without DDP/FSDP2).")

    def _params(self) -> list[Tensor]:
        """The wrapped parameters in state-dict order, listed afresh (same list if unchanged)."""
        self._listed = _grads.same_listing(self._listed, _grads.params_of(self.param_groups))
        return self._listed

    def _listing(self) -> list[Tensor]:
        """The parameters as last listed (listed again after ``add_param_group``)."""
        return self._listed or self._params()

    def backward(
        self, loss: Tensor, items: float | Tensor | None = None, *, hold: bool = False, **kw: Any
    ) -> None:
        """Run ``loss.backward(**kw)`` as exactly one micro-step, weighted by ``items``.

        Args:
            loss: a one-element real tensor that requires grad (under AMP ``scaler.scale(loss)``);
                with ``items``, the *summed* loss. A pass reaching no wrapped parameter counts.
            items: the items (samples, tokens) ``loss`` covers: a number >= 0 or a one-element
                tensor (read at the close without a host sync, unless the window is in items).
            hold: leave the micro-step uncounted (phase HELD) until :meth:`commit` or
                :meth:`drop_micro_step`. **kw: forwarded to ``Tensor.backward``.

        Raises:
            TypeError / ValueError: a bad ``loss`` or ``items``; weighted and unweighted
                micro-steps mixed; a window in items without ``items``.
            RuntimeError: the window is complete and waits for :meth:`step`; an earlier call
                or pass failed part-way. A refused call accumulates nothing."""
        _checks.check_loss(loss, "Accumulate.backward")
        if hold is not False and hold is not True:
            _checks.check_flag(hold, "hold")
        weight = self._check_micro_step("backward", items)
        seen, self._hold = self._passes, hold
        if weight is not None:
            PENDING.set(weight, self)
        try:
            loss.backward(**kw)  # type: ignore[no-untyped-call]
            if self._passes == seen and self._state.phase is OPEN:  # reached nothing watched
                self._end_pass(OPEN, weight)
        finally:
            if weight is not None:
                PENDING.clear(self)
            self._hold = False

    def next_items(self, items: float | Tensor) -> None:
        """Weight the next backward pass, one accumopt does not run (``accelerator.backward``),
        by ``items`` in every wrapper it reaches, as ``backward(loss_sum, items)``: a summed loss.

        Raises:
            ValueError: bad ``items``; a count already waits for its pass (:meth:`discard` drops
                it); unweighted micro-steps in the window; several ranks without a DDP/FSDP2
                model. RuntimeError: as :meth:`backward`. Nothing changes then."""
        if items is None:  # refused as no count, before a waiting one
            _checks.check_items(items, "next_items")
        PENDING.set(self._check_micro_step("next_items", items), self)

    def _check_micro_step(self, api: str, items: float | Tensor | None) -> float | Tensor | None:
        """Validate a coming micro-step against the window; returns its item count."""
        s = self._state
        if s.phase is not OPEN:  # first: a pass that failed part-way left its count waiting
            self.check_usable(api)
        if PENDING._owner is not None and (waiting := PENDING.items) is not None:
            raise ValueError(
                f"Accumulate.{api}: next_items({float(waiting):g}) is still waiting for its "
                "backward pass; expected one count per pass (opt.discard() drops it). Nothing "
                "changed."
            )
        weight = None if items is None else _checks.check_items(items, api, self._rules.in_items)
        if (refusal := self._rules.refusal(s, weight is not None)) is not None:
            raise refusal[0](f"{refusal[1]} Nothing was accumulated by this call.")
        if weight is not None:
            self._sync.check_weighted()
        return weight

    def _end_pass(self, before: Phase, items: float | Tensor | None) -> None:
        """The end of a backward pass (the counter's callback, or :meth:`backward`'s for one that
        reached nothing watched; ``before``: the phase it found): count, hold or break on it."""
        if "found_inf" in self.__dict__:  # left by a scaler.step(opt) interrupted around step()
            self.__dict__.pop("found_inf")  # (the scaler deletes them when step() returns): the
            self.__dict__.pop("grad_scale", None)  # next one would multiply the stale scale in
        self._passes += 1
        s, group = self._state, GROUP.members
        if before is HELD and group is not None and any(m is self for m in group):
            s.phase = HELD  # one more pass of the block's micro-step
            self._guard.passed(2 if self._sync.synced else 1)
            return
        problem: tuple[type[Exception], str] | None = None
        if before is not OPEN:
            problem = RuntimeError, _NOT_OPEN[before]
        elif (refusal := self._rules.refusal(s, items is not None)) is not None:
            problem = refusal
        elif not s.micro_step and self.driven_by is None and (fw := framework_accumulating()):
            problem = RuntimeError, _checks.refuse_framework(fw)  # asked once a window
        elif group is not None and items is not None:
            problem = ValueError, _GROUP_ITEMS
        if problem is not None:
            self._break("a backward pass could not join the window (see the error it raised)")
            raise problem[0](f"{problem[1]} {UNREFUSABLE}")
        if group is not None:
            group.append(self)
            self._held, s.phase = None, HELD
        elif self._hold:
            self._held, s.phase = items, HELD
        else:
            self._count(items)

    def commit(self) -> None:
        """Count the micro-step left HELD by ``backward(hold=True)``; RuntimeError if none waits."""
        if self._state.phase is not HELD:
            raise RuntimeError(
                f"Accumulate.commit: no micro-step waits to be counted (phase "
                f"{self._state.phase.value}); expected opt.backward(loss, hold=True) first."
            )
        self._count(self._held)

    def _count(self, items: float | Tensor | None) -> None:
        """Count the micro-step whose pass ended (its gradient is in ``.grad``)."""
        s = self._state
        s.phase, s.broken = BROKEN, _COUNTING
        items = self._sync.counted(items, s, self._rules)
        s.micro_step, s.weighted = s.micro_step + 1, items is not None
        s.stepped = s.did_update = False
        if items is not None:
            s.items += items
            if isinstance(items, Tensor):  # each count is checked at the close (no sync now)
                s.least = items if s.least is None else torch.minimum(s.least, items)
        synced = self._sync.synced  # each sync writes into .grad once more
        if hooks := self._micro_step_hooks:
            s.broken = _IN_HOOK
            try:
                for hook in hooks.values():
                    hook(self, items, synced)
            finally:
                s.broken = _COUNTING
        if s.micro_step > 1 and (problem := self._guard.passed(2 if synced else 1)):
            self._break(_WIPED)
            raise RuntimeError(problem)
        if self._rules.full(s):
            if s.found_inf is not None and self.scaler is not None:  # the closing pass's inf
                one = torch.ones((), device=s.found_inf.device)
                self._last_found = _grads.unscale_(_grads.grads_of(self._listing()), one)
            self._close()
            return
        buffer = self._buffer
        buffer.micro_step_done(self._listing)
        if isinstance(self._sync, GradSync):
            self._plan()
        if s.micro_step == 1:
            self._guard.note(self.param_groups, self._in_grad())
        elif self._guard.params is None and buffer.unfolded == 1:  # AMP: after a fold
            self._guard.note_grads(self._in_grad())
        s.phase = OPEN

    def _close(self) -> None:
        """Form the window's gradient in ``.grad`` (divided once); read tensor item counts."""
        s = self._state
        if isinstance(s.items, Tensor):  # one host sync: the total and the smallest count
            low = s.items if s.least is None else s.least
            total, low = torch.stack((s.items.double(), low.double())).tolist()
            covers = "its summed loss"
            _checks.check_count(low, "Accumulate: a micro-step's items", covers)
            s.items = _checks.check_count(total, "Accumulate: the window's items", covers)
        if (problem := self._guard.wiped()) is not None:
            self._break(_WIPED)
            raise RuntimeError(problem)
        self._guard.close_lrs(self.param_groups)
        self._sync.settle(s, self._rules)
        self._sync.close(self._buffer, self._params(), self._rules.divisor(s, self.world_size))
        s.phase = CLOSED  # formed: window hooks see it closed, and a hook that raises leaves it
        for hook in self._window_hooks.values():
            hook(self)

    def _in_grad(self) -> list[Tensor] | None:
        """The parameters whose window lives in ``.grad`` (None: the closing pass replaces it)."""
        sync, buffer = self._sync, self._buffer
        if sync.fsdp or getattr(sync.module, "gradient_as_bucket_view", False):
            return None
        params = self._listing()
        if buffer.unfolded:  # AMP: every micro-step waits in .grad for scaler.step
            return params
        buffered = {id(p) for p in buffer.buffered_params(params)}
        return [p for p in params if id(p) not in buffered] if buffered else params

    def _plan(self) -> None:
        """Plan the next pass's DDP/FSDP2 sync (the plan holds no reference to the wrapper)."""
        if isinstance(sync := self._sync, GradSync):
            buffer, groups = self._buffer, self.param_groups
            sync.plan(self._state, self._rules, lambda: buffer.grad_only(_grads.params_of(groups)))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """End a micro-step; at the boundary clip and step the inner optimizer (or skip the
        window) and set :attr:`did_update`. Returns the closure's value, or None.

        Args:
            closure: as for any torch optimizer: called once, with autograd on, before the step.

        Raises:
            RuntimeError: no backward pass since the last ``step()``; a failed call or pass; a
                second thread; a learning rate changed inside the window (nothing applied);
                ``scaler.step(opt)`` in a window without ``scaler=`` or after ``unscale_(opt)``."""
        loss = None
        if closure is not None:
            if self.driven_by is None and (fw := framework_accumulating(closure)):
                raise RuntimeError(_checks.refuse_framework(fw) + " Nothing was changed.")
            if self.driven_by is None and _checks.lightning_trainer(closure) is not None:
                raise RuntimeError(_checks.LIGHTNING_WITHOUT_CALLBACK)
            with torch.enable_grad():
                loss = closure()
        hooked = self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
        hooked = hooked or _global_optimizer_pre_hooks or _global_optimizer_post_hooks
        try:
            (_hooked_step if hooked else Accumulate._step)(self)
        except BaseException:  # GradScaler.step deletes these only when step() returns
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            raise
        return loss

    step.hooked = True  # type: ignore[attr-defined]  # torch's Optimizer leaves it unwrapped

    def _step(self) -> None:
        s, amp = self._state, self.__dict__.get("found_inf")  # set by GradScaler.step
        if amp is not None:
            self._amp_step(amp)
        elif s.phase is OPEN and not s.stepped and self._thread == get_ident():
            s.stepped, s.did_update = True, False  # a micro-step inside the window
        elif s.phase is CLOSED and self._thread == get_ident() and not self._scaled():
            self._apply(None)
        else:
            self._step_refusal()

    def _step_refusal(self) -> None:
        """The rest of ``step()``: bind the first thread, run DCP's state init, or refuse."""
        if self._thread is None:
            self._thread = get_ident()
            return self._step()
        if self._thread != get_ident():
            self._break("step() was called from a second thread")
            raise RuntimeError(
                "Accumulate.step: called from a second thread; expected the thread whose passes "
                "it counts. Use one Accumulate per thread; opt.discard() drops the window."
            )
        self.check_usable("step")
        if self._state.phase is OPEN and _checkpoint.dcp_init_step(self):
            return None
        hint = "Check that the loss depends on the wrapped parameters"
        if self.model is not None:
            hint += f", computed from the outputs of the {type(self.model).__qualname__} given "
            hint += "as model= (the compiled module under torch.compile), or use opt.backward(loss)"
        if self._counter.retired:
            hint = "It was released (opt.release(), at the end of a fit): call opt.reattach()"
        raise RuntimeError(
            f"Accumulate.step: no backward pass since the last step(); expected one. {hint}."
        )

    def _scaled(self) -> bool:
        """Refuse a plain ``step()`` on a closed window still in scaled units; else False."""
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            return False
        state = scaler._per_optimizer_states.get(id(self))
        if state is not None and state["stage"] is OptState.UNSCALED:
            return False
        raise RuntimeError(
            "Accumulate.step: the window is complete, but its gradient is still scaled; expected "
            "scaler.step(opt) (the scaler= GradScaler), then scaler.update(). Nothing was applied."
        )

    def _amp_step(self, found_inf: Tensor | int) -> None:
        """``scaler.step(opt)``: inside the window, fold the micro-step with its own loss scale;
        at the boundary, apply the window unless a micro-step had an inf/NaN (over the ranks)."""
        s, scaler, grad_scale = self._state, self.scaler, self.__dict__.get("grad_scale")
        if isinstance(found_inf, Tensor):  # else 0: no gradient reached the scaler
            found = found_inf
        elif scaler is None:
            found = torch.zeros(())
        else:  # recorded in the scaler too, or scaler.update() would refuse
            scale = scaler._get_scale_async()
            assert scale is not None
            found = torch.zeros((), dtype=torch.float32, device=scale.device)
            scaler._per_optimizer_states[id(self)]["found_inf_per_device"][scale.device] = found
        last, self._last_found = self._last_found, None
        if s.phase is CLOSED and last is not None and scaler is not None:
            # the scaler backs off for the closing pass's own inf/NaN, as at every micro-step
            flags = scaler._per_optimizer_states[id(self)]["found_inf_per_device"].values()
            for i, flag in enumerate(flags):
                flag.copy_(last if i == 0 else torch.zeros_like(flag))
            found = last.to(found.device)
        if scaler is not None and isinstance(self._sync, GradSync):
            found = self._sync.agreed_found_inf(scaler, self, found)
        if s.phase is CLOSED:
            self._gated = scaler is None  # PyTorch's recipe: scaled between boundaries
            return self._apply((grad_scale, found))
        if s.phase is not OPEN or s.stepped:
            return self._step_refusal()
        if scaler is None:
            raise RuntimeError(
                "Accumulate.step: scaler.step(opt) inside an open window, but the wrapper was "
                "built without scaler=. Pass it, or step the scaler only at boundaries. Nothing "
                "changed."
            )
        if grad_scale is None:  # scaler.unscale_(opt) ran on a partial window
            self._break("scaler.unscale_(opt) ran inside an open window")
            raise RuntimeError(
                "Accumulate.step: scaler.unscale_(opt) ran inside an open window (clipping there "
                "clips a partial sum). Unscale and clip only when opt.will_update, or use "
                "max_grad_norm=; opt.discard() drops this window."
            )
        s.phase, s.broken = BROKEN, _FOLDING
        if (problem := self._guard.wiped()) is not None:
            self._break(_WIPED)
            raise RuntimeError(problem)
        s.found_inf = found if s.found_inf is None else s.found_inf + found
        self._buffer.fold_scaled(self._params(), grad_scale)
        self._guard.forget_grads()
        s.stepped, s.did_update, s.phase = True, False, OPEN

    def _apply(self, amp: tuple[Tensor | None, Tensor] | None, clear: bool = False) -> None:
        """Apply the closed window (a learning rate changed inside it is refused, the window
        intact): skip it (no items, or an inf/NaN) or unscale, clip and step; open the next."""
        if (problem := self._guard.lr_changed(self.param_groups)) is not None:
            raise RuntimeError(problem)
        s = self._state
        s.phase, s.broken = BROKEN, _APPLYING
        params = self._listing()  # listed at the close
        grad_scale, found = None, s.found_inf
        if amp is not None:
            grad_scale, found = amp[0], (amp[1] if found is None else found + amp[1])
        skip = self._rules.divisor(s, self.world_size) is None  # no items
        if not skip and found is not None:  # an inf/NaN under AMP
            skip = bool(found.item() > 0)
        elif not skip and self.nonfinite == "skip_window":  # one host sync
            skip = not _grads.all_finite(_grads.grads_of(params))
        grad_norm = None
        if not skip:
            if grad_scale is not None:
                _grads.div_(_grads.grads_of(params), grad_scale)
            if self.max_grad_norm is not None:
                grad_norm = _grads.clip_(params, self.max_grad_norm)
            updates, s.phase = s.updates, APPLY
            try:
                self.optimizer.step()  # its post-step hook counts the update (_watch_inner)
            except BaseException:
                if s.updates > updates:  # applied, then a later post-step hook raised
                    self._finish(grad_norm, clear=True)
                else:  # the inner step failed before its update: refusing until discard()
                    s.phase = BROKEN
                raise
        else:
            self.optimizer.zero_grad(set_to_none=True)
            _LOG.info("Accumulate: window %d skipped (inf/NaN or no items)", s.updates + 1)
        self._finish(grad_norm, clear)

    def _finish(self, grad_norm: Tensor | None, clear: bool) -> None:
        """After the update (or skip): report, run the update hooks, clear ``.grad`` if ``clear``,
        open the next window; a failure here still opens it (``.grad`` cleared), then raises."""
        s = self._state
        report = Window(s.micro_step, cast(float, s.items), grad_norm, s.did_update)
        self.last_window = report
        try:
            for hook in self._update_hooks.values():
                hook(self, report)
            if clear:
                self.optimizer.zero_grad(set_to_none=True)
            self._open(ask=False)
            self._ask()
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)  # raising again: BROKEN stays
            if s.phase is not OPEN:
                self._open(ask=False)
            raise

    def _open(self, ask: bool = True) -> None:
        s = self._state
        self._guard.forget()
        self._buffer.reset()
        self._last_found = None
        params, multi = self._params(), distributed()
        if isinstance(self._sync, LocalSync):  # a DDP model not given to the wrapper syncs
            self._sync.synced = multi
        self._counter.requeue = isinstance(self._sync, GradSync) or multi
        first = (params[0].dtype, params[0].device)
        if first != self._dtypes:  # model.to(dtype or device) gave new autograd nodes
            self._dtypes = first
            self._counter.refresh()
        self._rules.open(s)
        s.stepped, s.phase = True, OPEN
        self._plan()
        if ask:
            self._ask()

    def _ask(self) -> None:
        """Size the open window by its schedule; raise a bad size, or its error, once it is open."""
        try:
            problem = self._rules.sized(self._state)
        finally:
            self._plan()
        if problem is not None:
            raise ValueError(problem)

    def flush(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """Apply the open, partial window now (its own exact mean; an epoch's end), then clear
        the gradients; returns :attr:`did_update`. ``scaler``: the ``GradScaler`` of PyTorch's
        gated AMP recipe (no ``scaler=``), which then applies the window (``step``, ``update``).

        Raises:
            RuntimeError: an earlier call or pass failed part-way; FSDP2 holds the window
                unreduced (``reduce_every_micro_step``); a gated AMP loop without ``scaler``.
            TypeError: ``scaler`` is not a ``GradScaler``."""
        s = self._state
        self.check_usable("flush")
        amp = _checks.check_scaler(scaler) is not None and scaler.is_enabled()  # type: ignore[union-attr]
        if self._gated and not amp and self.scaler is None and s.micro_step:
            raise RuntimeError(
                "Accumulate.flush: this loop steps through a GradScaler at its boundaries, so the "
                "open window's gradient is still scaled; call opt.flush(scaler). Nothing changed."
            )
        self._sync.release(s, flushing=True)
        if s.phase is OPEN and not s.micro_step:
            s.did_update = False
            return False
        if s.phase is OPEN:
            s.phase, s.broken = BROKEN, _FLUSHING
            self._close()
        if amp:
            scaler.step(self)  # type: ignore[union-attr]
            scaler.update()  # type: ignore[union-attr]
            self.optimizer.zero_grad(set_to_none=True)
            return s.did_update
        scale = self._buffer.loss_scale()
        if scale is not None:  # the closed window is in scaled units: refuse before unscaling
            if (problem := self._guard.lr_changed(self.param_groups)) is not None:
                raise RuntimeError(problem)
            s.phase, s.broken = BROKEN, _FLUSHING  # unscaled part-way: only discard() goes on
            found = _grads.unscale_(_grads.grads_of(self._params()), scale)
            s.found_inf = found if s.found_inf is None else s.found_inf + found
        self._apply(None, clear=True)
        return s.did_update

    def discard(self) -> None:
        """Drop the open window (its gradients and counts; the inner optimizer is untouched)."""
        self._drop_window(release=True)

    def _drop_window(self, release: bool) -> None:
        """Drop the open window; ``release`` (``discard()``): the model's own sync setting until
        the next micro-step, else the planned one (a checkpoint's window goes on)."""
        s = self._state
        s.phase, s.broken = BROKEN, _DISCARDING
        self.optimizer.zero_grad(set_to_none=True)
        PENDING.clear(self)
        if release:
            self._sync.release(s)
        else:
            self._sync.drop_pending()
        s.did_update, s.broken = False, ""
        self._open()

    def drop_micro_step(self) -> None:
        """Drop the micro-step in flight (failed part-way, or HELD), keeping the finished ones
        (in the rollback buffer: ``buffer=True``, :meth:`enable_rollback`, or none). RuntimeError:
        the window is complete; finished micro-steps live in ``.grad``; a failed call."""
        s = self._state
        if s.phase in (BROKEN, APPLY):
            self.check_usable("drop_micro_step")
        if s.phase is CLOSED or not self._buffer.separable(s.micro_step):
            why = (
                "the window is complete and its gradient formed"
                if s.phase is CLOSED
                else "finished micro-steps share .grad with the one in flight, so it cannot be "
                "dropped alone; use buffer=True (and scaler.step(opt) after every backward pass)"
            )
            drops = "opt.discard() drops the whole window"
            raise RuntimeError(f"Accumulate.drop_micro_step: {why}; {drops}.")
        for p in self._params():
            p.grad = None
        PENDING.clear(self)
        self._held, s.phase = None, OPEN

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients only between windows (else a no-op, so it never wipes a
        window); also clears what a backward pass that died in an empty window left."""
        s = self._state
        if s.micro_step == 0 and (s.phase is OPEN or s.phase is PASS):
            self.optimizer.zero_grad(set_to_none=set_to_none)
            s.phase = OPEN
            self._counter.watch_groups(self.param_groups)  # parameters unfrozen since

    def enable_rollback(self) -> None:
        """Route every parameter through the window buffer from now on, so that a failed
        micro-batch can be dropped alone. RuntimeError: ``buffer=False``; FSDP2; a failed call."""
        if self.buffer is False or self._sync.fsdp:
            why = "built with buffer=False" if self.buffer is False else "an FSDP2 model's"
            raise RuntimeError(
                f"Accumulate.enable_rollback: {why} gradients cannot be rolled back per "
                "micro-batch; expected buffer=None or True, and a DDP or single-process model."
            )
        self.check_usable("enable_rollback")
        s = self._state
        before, s.phase, s.broken = s.phase, BROKEN, _ROUTING
        if not self._buffer.unfolded:
            self._guard.forget_grads()  # the window moves out of .grad on purpose
        self._buffer.route_all(self._params(), s.micro_step if before is OPEN else 0)
        self._plan()
        s.phase = before

    @property
    def rollback(self) -> bool:
        """Whether every parameter goes through the window buffer (:meth:`drop_micro_step`)."""
        return self._buffer.buffer_all

    def disable_rollback(self) -> bool:
        """Keep the window that opens next in ``.grad`` (no rollback buffer), unless built with
        ``buffer=True``; returns whether it did. Only between windows (else False)."""
        if self.buffer is True or self._state.micro_step or self._state.phase is not OPEN:
            return False
        self._buffer.buffer_all = False
        self._buffer.forget_params()
        return True

    def check_usable(self, api: str = "check_usable") -> None:
        """Raise the RuntimeError (naming ``api``) that every call but ``discard()`` and
        ``load_state_dict()`` raises now (phase PASS, HELD, APPLY or BROKEN), if any."""
        s = self._state
        if s.phase is OPEN or s.phase is CLOSED:
            return
        if s.phase is PASS:
            why = (
                "the last backward pass ran under compiled autograd, whose end accumopt cannot "
                "see; turn it off (compiling the model is fine) and call opt.discard()."
                if s.broken == COMPILED_AUTOGRAD
                else "an earlier backward pass failed part-way (an OOM, say), leaving a partial "
                "gradient in .grad. Call opt.discard(), or opt.drop_micro_step() with rollback."
            )
        elif s.phase is HELD:
            why = "a micro-step waits for opt.commit() or opt.drop_micro_step()."
        elif s.broken is _IN_HOOK:
            why = f"{_IN_HOOK}."
        else:
            why = f"{s.broken}; call opt.discard() (or load_state_dict()) first."
        raise RuntimeError(f"Accumulate.{api}: {why} {api}() changed nothing.")

    def _break(self, why: str) -> None:
        """Refuse all but ``discard()`` and ``load_state_dict()``, saying ``why``."""
        self._state.broken, self._state.phase = why, BROKEN

    def set_model(self, model: torch.nn.Module, *, count_at: str = "outputs") -> None:
        """``Accumulate(..., model=model)`` after the wrapper was built (a framework wrapped the
        model later). ``count_at="parameters"``: count passes at the parameters, sync through the
        model (a backward run inside DDP's forward); not for FSDP2.

        Raises:
            RuntimeError: a window is open, or a failed call. TypeError / ValueError: as
                ``model=``. Nothing changes when it raises."""
        if self._state.micro_step or self._state.phase is not OPEN:
            self.check_usable("set_model")
            raise RuntimeError(
                f"Accumulate.set_model: a window of {self._state.micro_step} micro-step(s) is "
                "open; call set_model() between windows (opt.flush() first). Nothing changed."
            )
        self._bind(model, count_at)

    def _bind(self, model: Any, count_at: str) -> None:
        """Count passes for ``model`` (or at the parameters), sync through it; checks first."""
        model = _checks.check_model(model, self.optimizer)
        if count_at not in ("outputs", "parameters"):
            raise ValueError(
                f"Accumulate.set_model: count_at={count_at!r}; expected 'outputs' or 'parameters'."
            )
        distributed = is_distributed(model)
        fsdp = distributed and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if fsdp:
            flag, buffer_all = self.reduce_every_micro_step, self._buffer.buffer_all
            _checks.check_fsdp(count_at, self._rules.in_items, flag, self.scaler, buffer_all)
            if self.__dict__.get("noise_scale") is not None:
                raise ValueError(
                    "Accumulate: noise_scale with an FSDP2 model is not supported; expected a "
                    "single process or DDP (the estimate needs each rank's own gradient)."
                )
        params = _grads.params_of(self.param_groups)
        sync = sync_for(model, params[0].device, self.reduce_every_micro_step)
        module = model if count_at == "outputs" else None
        requeue = distributed and not fsdp
        counter = Counter(self._state, self._end_pass, module, confirm=not fsdp, requeue=requeue)
        counter.watch_groups(self.param_groups)
        if "_counter" in self.__dict__:  # not in __init__
            self._counter.remove()
        self._sync.release(self._state)
        self._sync.remove()
        self.model, self._sync, self._counter = model, sync, counter
        group = self.param_groups[0]  # DCP keeps the entry of the live key (_checkpoint)
        for key in [k for k in group if str(k).startswith(_checkpoint.KEY)]:
            del group[key]
        group[_checkpoint.key_for(sync.rank)] = None
        self._dtypes = (params[0].dtype, params[0].device)
        self._plan()

    def release(self) -> None:
        """Stop counting passes (hooks removed; the window stays); :meth:`reattach` undoes it."""
        self._counter.remove()

    def reattach(self) -> None:
        """Count passes again as before :meth:`release` (a no-op if it was not released)."""
        if self._counter.retired:
            self._bind(self.model, "parameters" if self._counter._module is None else "outputs")

    def register_micro_step_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(opt, items, synced)`` at every counted micro-step, before the wrapper
        moves or divides anything (``.grad``: the window's running sum). ``items``: its count
        (over the ranks in a window in items) or None; ``synced``: whether DDP/FSDP2 synced it."""
        return _register(self._micro_step_hooks, hook, "micro_step")

    def register_window_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(opt)`` when the window's gradient is formed in ``.grad`` (at the end of
        the closing pass, or in ``flush()``), before ``step()`` applies it."""
        return _register(self._window_hooks, hook, "window")

    def register_update_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(opt, report)`` after each boundary, applied or skipped (``report``: the
        :attr:`last_window`), before the next window opens."""
        return _register(self._update_hooks, hook, "update")

    def all_reduce_(self, tensors: list[Tensor]) -> None:
        """Sum ``tensors`` over the ranks of the wrapper's DDP/FSDP2 model, in place (one
        flattened all-reduce per dtype and device); nothing in one process."""
        if isinstance(self._sync, GradSync):
            self._sync.sum_grads(tensors)

    def sum_over_ranks(self, a: float, b: float = 0.0, what: str = "") -> tuple[float, float]:
        """``(a, b)`` summed over the ranks of the wrapper's DDP/FSDP2 model (one small collective;
        as given in one process); RuntimeError on every rank if they disagree (``what``: where)."""
        return self._sync.sum_over_ranks(float(a), float(b), what)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (and count passes through it)."""
        inner = self.__dict__.get("optimizer")
        if inner is None:  # Optimizer.__init__ filling our throw-away copies
            return super().add_param_group(param_group)
        inner.add_param_group(param_group)
        self._listed = None
        self._buffer.forget_params()
        self._counter.watch(self.param_groups[-1]["params"])

    def train(self) -> None:
        """The inner optimizer's ``train()`` where it has one (schedule-free optimizers)."""
        getattr(self.optimizer, "train", lambda: None)()

    def eval(self) -> None:
        """The inner optimizer's ``eval()`` where it has one (schedule-free optimizers)."""
        getattr(self.optimizer, "eval", lambda: None)()

    state_dict = _checkpoint.state_dict
    load_state_dict = _checkpoint.load_state_dict

    def loadable(self, state_dict: Any) -> str | None:
        """Why :meth:`load_state_dict` would refuse ``state_dict`` (its message), or None."""
        try:
            _checkpoint.check(self, state_dict)
        except (TypeError, ValueError) as err:
            return str(err)
        return None

    def agree_on_loads(self, all_ranks: Callable[[bool], bool]) -> RemovableHandle:
        """For a framework loading one rank's optimizer state on every rank (Lightning's DDP):
        before each load, ``all_ranks(ok)`` (a collective: is ``ok`` true on every rank?) agrees
        that each can load it; all raise ValueError if one cannot. Returns the hook's handle."""

        def agree(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
            problem = cast(Accumulate, opt).loadable(state)
            if not all_ranks(problem is None):
                raise ValueError(
                    problem
                    or "Accumulate.load_state_dict: another rank refused the checkpoint's open "
                    "window (see its error); resume from a boundary checkpoint. Nothing changed."
                )

        return self.register_load_state_dict_pre_hook(agree)

    __getstate__ = _checkpoint.getstate
    __setstate__ = _checkpoint.setstate

    def __repr__(self) -> str:
        every, every_items = self._rules.spec()
        window = f"every={every!r}" if every is not None else f"every_items={every_items!r}"
        return f"Accumulate({window}, reduction={self.reduction!r}, optimizer={self.optimizer!r})"


_hooked_step = torch.optim.Optimizer.profile_hook_step(Accumulate._step)


def _warn_unapplied(state: State) -> None:
    """Warn at a wrapper's (or the process's) end when micro-steps were never applied."""
    if state.micro_step and state.phase is not BROKEN:
        warnings.warn(
            f"Accumulate: a wrapper ended with {state.micro_step} micro-step(s) of an open window "
            "never applied; call opt.flush() where the data ends (opt.discard() drops it).",
            stacklevel=1,
        )


def _register(hooks: _Hooks, hook: Any, kind: str) -> RemovableHandle:
    if not callable(hook):
        raise TypeError(
            f"Accumulate.register_{kind}_hook: hook={hook!r} is not callable; expected a "
            "function of the arguments the method's docstring names. Nothing was registered."
        )
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def _watch_inner(inner: torch.optim.Optimizer, owner: Accumulate) -> None:
    """Hooks on the inner optimizer, removed with ``owner``: one refuses a step the wrapper did
    not start; one, run first after the step, counts the update as soon as it is applied."""
    ref, s = weakref.ref(owner), owner._state

    def before(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if s.phase is not APPLY and ref() is not None:
            raise RuntimeError(STEPPED_DIRECTLY.format(name=type(optimizer).__name__))

    def after(*_: Any) -> None:
        if s.phase is APPLY:  # one statement: an interrupt lands before or after all
            seen = s.items_seen + cast(float, s.items)
            s.updates, s.items_seen, s.did_update, s.phase = s.updates + 1, seen, True, BROKEN

    post = inner.register_step_post_hook(after)
    inner._optimizer_step_post_hooks.move_to_end(post.id, last=False)  # type: ignore[attr-defined]
    pre = inner.register_step_pre_hook(before)
    weakref.finalize(owner, post.remove)
    weakref.finalize(owner, pre.remove)


def _attach_noise(opt: Accumulate, noise_scale: Any) -> Any:
    """The noise-scale estimator subscribed to ``opt``'s hooks (a schedule that needs one,
    ``schedules.AdaptiveBatch``, turns it on), or None."""
    from accumopt.noise import NoiseScale  # noise imports nothing of the wrapper at import

    schedule = opt._rules.schedule
    wants = callable(getattr(schedule, "bind_noise_scale", None))
    if noise_scale is True or (wants and (noise_scale is None or noise_scale is False)):
        noise_scale = NoiseScale()
    elif noise_scale is None or noise_scale is False:
        return None
    if not isinstance(noise_scale, NoiseScale):
        raise TypeError(
            f"Accumulate: noise_scale={noise_scale!r}; expected True, False or an "
            "accumopt.noise.NoiseScale (e.g. NoiseScale(decay=0.9))."
        )
    noise_scale.attach(opt)
    if wants:
        schedule.bind_noise_scale(noise_scale, opt._rules.in_items)  # type: ignore[union-attr]
    return noise_scale

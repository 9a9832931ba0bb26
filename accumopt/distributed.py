"""Every cross-rank decision and collective of accumopt (DDP, FSDP2). In a window only the closing
pass syncs gradients (or accumopt all-reduces the window once at the boundary); each per-rank
decision is first agreed on accumopt's own gloo group (:meth:`GradSync._agree`)."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from accumopt import _grads
from accumopt._buffer import WindowBuffer
from accumopt._counting import distributed
from accumopt._state import Phase, Rules, State

_Items = float | Tensor | None
_Pair = tuple[float, float]

# Positions in the window, stamped on every small collective
_ITEMS, _CLOSE, _FLUSH, _BEFORE_CLOSE, _FOUND_INF, _OTHER, _REOPEN = range(7)
_WHERE = (
    "counting micro-step {m} of a window in items",
    "closing a window at micro-step {m}",
    "flush() with {m} micro-step(s) pending",
    "at the forward of the micro-step after {m}, which closes the window",
    "scaler.step after micro-step {m}",
    "agreeing on {what}",
    "at the first forward after flush() or discard()",
)
_TOGETHER = "Run the same micro-steps per window and flush() on every rank together"
_DTENSOR = "torch.distributed.tensor"
_SIDE: dict[tuple[int, ...], tuple[object, Any]] = {}  # ranks -> (world group, agreement group)


def _imported(module: str, name: str) -> Any:
    """The class ``module.name``, or ``()`` (nothing is one) if nobody imported ``module``."""
    found = sys.modules.get(module)
    return () if found is None else getattr(found, name)


def _is_fsdp(module: nn.Module | None) -> bool:
    return isinstance(module, _imported("torch.distributed.fsdp", "FSDPModule"))


def is_distributed(module: nn.Module | None) -> bool:
    """Whether ``module`` synchronises gradients across ranks (DDP, or an FSDP2 root)."""
    return isinstance(module, nn.parallel.DistributedDataParallel) or _is_fsdp(module)


def _agreement_group(group: Any) -> Any:
    """accumopt's own gloo group over ``group``'s ranks (cached); ``group`` if not the world's."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
    if len(ranks) != dist.get_world_size():
        return group
    cached = _SIDE.get(ranks)
    if cached is not None and cached[0] is world:
        return cached[1]
    timeout = None
    with contextlib.suppress(AttributeError, RuntimeError):  # the world's (private API)
        timeout = world._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    side = dist.new_group(backend="gloo", timeout=timeout)
    _SIDE[ranks] = (world, side)
    return side


class LocalSync:
    """The single-process stand-in for :class:`GradSync`: one rank, no collective."""

    fsdp, rank, world_size, module = False, 0, 1, None
    synced = False  #: a process group exists: a DDP model not given to the wrapper syncs

    def _nothing(self, *args: Any, **kwargs: Any) -> None: ...  # nothing to do in one process

    plan = settle = release = restored = remove = drop_pending = _nothing

    def check_weighted(self) -> None:
        """Refuse items under several ranks without a DDP/FSDP2 model to sum them through."""
        if distributed() and (n := dist.get_world_size()) > 1:
            raise ValueError(
                f"Accumulate: items under {n} ranks, but no DDP/FSDP2 model to sum them over. "
                "Call opt.set_model(ddp_model) (or pass model=); nothing changed."
            )

    def counted(self, items: _Items, state: State, rules: Rules) -> _Items:
        return items  # this process's own

    def close(self, buffer: WindowBuffer, params: list[Tensor], divisor: float | None) -> None:
        buffer.close(params, divisor)

    def sum_over_ranks(self, a: float, b: float, what: str) -> _Pair:
        return a, b


def sync_for(model: nn.Module | None, device: torch.device, every_step: bool) -> Any:
    """A :class:`GradSync` for a DDP/FSDP2 model, else a :class:`LocalSync`."""
    return GradSync(model, device, every_step) if is_distributed(model) else LocalSync()


class GradSync:
    """The gradient sync of ``module`` (DDP, an FSDP2 root; each micro-step if ``every_step``) and
    accumopt's collectives on ``device`` (``all_reduces``: those with data; ``synced``: DDP/FSDP2
    synchronised the last counted pass)."""

    def __init__(self, module: Any, device: torch.device, every_step: bool = False) -> None:
        self.fsdp = _is_fsdp(module)
        self.module, self.device, self.every_step = module, device, every_step
        self.group = None if self.fsdp else module.process_group
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.side = _agreement_group(self.group)
        self.all_reduces, self.synced = 0, False
        self._enabled = True  # FSDP2's default (it has no public getter)
        own = self._own = self._enabled if self.fsdp else bool(module.require_backward_grad_sync)
        self._planned = own
        # DDP's static_graph: its first pass must sync (a loaded window's too: exact, a synced
        # pass reduces all that .grad holds); the module's own setting holds until it
        self._first_syncs = bool(getattr(module, "static_graph", False))
        self._released = self._first_syncs and own
        self._bound: tuple[State, Rules, Callable[[], bool]] | None = None
        self._closing_planned = self._checked_before = self._closing_checked = False
        ref = weakref.ref(self)

        def before_forward(module: nn.Module, args: Any) -> None:
            sync = ref()  # weakly: the module must not keep a dropped wrapper's sync
            if sync is not None:
                sync.before_forward()

        hook = module.register_forward_pre_hook(before_forward, prepend=True)
        self._finalizer = weakref.finalize(self, _restore, module, self.fsdp, own, hook)
        self._finalizer.atexit = False

    def remove(self) -> None:
        """Give the module its own sync setting back; remove accumopt's hook."""
        self._finalizer()

    def _set(self, enabled: bool) -> None:
        if not self.fsdp:
            self.module.require_backward_grad_sync = enabled
        elif enabled != self._enabled:
            self.module.set_requires_gradient_sync(enabled)
            self._enabled = enabled

    def plan(self, state: State, rules: Rules, grad_only: Callable[[], bool]) -> None:
        """Sync the next pass only if it closes the window and the window is all in ``.grad``
        (else accumopt reduces it); released, an empty window keeps the module's own setting."""
        self._bound = (state, rules, grad_only)
        empty = state.micro_step == 0 and state.phase is not Phase.CLOSED
        self._checked_before = self._checked_before and state.micro_step > 0
        self._released = self._released and empty
        self._closing_planned = False
        if self._released:
            self._planned = self._own
        elif self.every_step or self._first_syncs:
            self._planned = True
        else:
            self._planned = self._closing_planned = rules.next_closes(state) and grad_only()
        self._set(self._planned)

    def before_forward(self) -> None:
        """The planned sync again (``no_sync()`` may reset it); agree before a closing pass, and
        before the first pass after ``flush()``/``discard()`` (released, it syncs: a rank that
        discarded alone would pair it with another rank's closing sync)."""
        if self._bound is None:
            return
        state, rules, grad_only = self._bound
        if state.size is None and rules.sized(state) is None:
            self.plan(state, rules, grad_only)
        if not self._released:
            self._set(self._planned)
        if self._checked_before or not torch.is_grad_enabled() or state.phase is not Phase.OPEN:
            return
        if self._closing_planned:
            self._checked_before = True
            self._agree(_BEFORE_CLOSE, state.micro_step)
        elif self._released and self._own and self.module.training:
            self._checked_before = True
            self._agree(_REOPEN, state.micro_step)

    def release(self, state: State, flushing: bool = False) -> None:
        """``flush()``/``discard()``: the module's own sync setting until the next micro-step."""
        if flushing and state.micro_step == 0:
            self._agree(_FLUSH, 0)
        elif self.fsdp and flushing and not (state.phase is Phase.CLOSED or self.every_step):
            raise RuntimeError(
                f"Accumulate.flush: the open window of {state.micro_step} micro-step(s) is held by "
                "FSDP2 without a gradient sync (done only in a synced backward). Use windows that "
                "end with the data, reduce_every_micro_step=True, or opt.discard()."
            )
        elif not flushing:
            self.drop_pending()
        self._released, self._closing_planned = True, False
        self._set(self._own)

    def drop_pending(self) -> None:
        """Drop what FSDP2 holds back of a dropped window (nothing under DDP)."""
        if self.fsdp:
            _drop_fsdp_pending(self.module)

    def check_weighted(self) -> None:
        """Items are summed over the ranks: always possible."""

    def counted(self, items: _Items, state: State, rules: Rules) -> _Items:
        """Count a micro-step: its items over the ranks in a window in items, else its own."""
        self.synced = self._enabled if self.fsdp else bool(self.module.require_backward_grad_sync)
        self._released = self._first_syncs = False
        self._closing_checked = self._checked_before and self._closing_planned
        self._checked_before = False
        if items is None or not rules.in_items:
            return items
        return self._agree(_ITEMS, state.micro_step + 1, (cast(float, items), 0.0))[0]

    def restored(self, state: State) -> None:
        """A window was loaded: none of its passes was synced (unless all are)."""
        self.synced = self.every_step
        self._released = self._checked_before = self._closing_checked = False

    def agreed_found_inf(self, scaler: Any, opt: Any, found_inf: Tensor) -> Tensor:
        """Under ``scaler.step(opt)``: an inf/NaN seen by any rank, on every rank and in the
        scaler's record (the same windows skipped, one loss scale)."""
        flags = list(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        own = sum(float(f.item()) for f in flags)
        found = self._agree(_FOUND_INF, opt._state.micro_step, (own, 0.0))[0] > 0
        for flag in flags:
            flag.fill_(float(found))
        return found_inf.new_full((), float(found))

    def settle(self, state: State, rules: Rules) -> None:
        """At the close or ``flush()``: agree all close here (once), summing weighted items."""
        full, checked = rules.full(state), self._closing_checked
        self._closing_checked = False
        where = _CLOSE if full else _FLUSH
        if state.weighted and not rules.in_items:
            state.items = self._agree(where, state.micro_step, (cast(float, state.items), 0.0))[0]
        elif not full or not (rules.in_items or checked):
            self._agree(where, state.micro_step)

    def sum_over_ranks(self, a: float, b: float, what: str) -> _Pair:
        """``(a, b)`` summed over the ranks; RuntimeError on every rank if one is elsewhere."""
        return self._agree(_OTHER, 0, (a, b), what)

    def _agree(self, where: int, step: int, values: _Pair | None = None, what: str = "") -> _Pair:
        """Sum ``values`` over the ranks in rank order (None: only check) by one all-gather of 4
        float64 per rank (the values, and the position: what, at which micro-step, after how many
        updates); RuntimeError on every rank unless all are at this position."""
        code = float(step * len(_WHERE) + where)
        a, b = values or (0.0, 0.0)
        updates = float(self._bound[0].updates) if self._bound is not None else 0.0
        mine = torch.tensor([a, b, code, updates], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, mine, group=self.side)
        except RuntimeError as err:
            raise RuntimeError(
                f"Accumulate: this rank was {_describe(code, what)}; not every rank joined in "
                f"time ({str(err)[:200]}). {_TOGETHER}."
            ) from err
        if values is not None:
            self.all_reduces += 1
        rows = [p.tolist() for p in parts]
        if any(r[2:] != [code, updates] for r in rows):
            seen = "; ".join(
                f"rank {i}: {_describe(r[2], what)}, after {r[3]:.0f} update(s)"
                for i, r in enumerate(rows)
            )
            raise RuntimeError(
                "Accumulate: the ranks are at different points of the accumulation window "
                f"({seen}); nothing of it was applied. {_TOGETHER}, then opt.discard() everywhere."
            )
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    def close(self, buffer: WindowBuffer, params: list[Tensor], divisor: float | None) -> None:
        """Form the window's gradient over all ranks in ``.grad``, divided by ``divisor``."""
        if self.synced:  # DDP's reducer averaged the window over the ranks already
            buffer.close(params, None if divisor is None else divisor / self.world_size)
            return
        buffer.close(params, None)  # one all-reduce of the whole window's gradient
        trainable = [p for p in params if p.requires_grad]
        used = torch.tensor([float(p.grad is not None) for p in trainable], device=self.device)
        dist.all_reduce(used, group=self.group)  # > 0: used on some rank
        self.all_reduces += 1
        for p in trainable:
            if p.grad is None:  # every rank must reduce the same tensors
                p.grad = torch.zeros_like(p)
        self.sum_grads([p.grad for p in trainable])  # type: ignore[misc]
        for p, anywhere in zip(trainable, used.tolist()):
            if not anywhere:  # unused on every rank: no gradient, as in one process
                p.grad = None
        if divisor is not None and divisor != 1:
            _grads.div_(_grads.grads_of(trainable), divisor)

    @torch.no_grad()
    def sum_grads(self, grads: list[Tensor]) -> None:
        """Sum same-shaped dense gradients over the ranks in place (one all-reduce per kind)."""
        if any(g.is_sparse for g in grads):
            raise RuntimeError(
                "Accumulate: cannot sum sparse gradients over ranks; expected dense."
            )
        for tensors in _grads.by_kind(grads).values():
            flat = _flatten_dense_tensors(tensors)  # type: ignore[no-untyped-call]
            dist.all_reduce(flat, group=self.group)
            self.all_reduces += 1
            pieces = _unflatten_dense_tensors(flat, tensors)  # type: ignore[no-untyped-call]
            for g, reduced in zip(tensors, pieces):
                g.copy_(reduced)


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's local shard of a DTensor (FSDP2), or ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, _imported(_DTENSOR, "DTensor")) else tensor


def shard_like(tensor: Tensor, param: Tensor) -> Tensor:
    """A saved gradient (a local shard) copied as ``param`` holds one (device; DTensor layout)."""
    dtensor = _imported(_DTENSOR, "DTensor")
    if not isinstance(param, dtensor):
        return tensor.to(device=param.device, copy=True)
    local = tensor.to(device=param.to_local().device, copy=True)
    layout = {"shape": param.shape, "stride": param.stride(), "run_check": False}
    return cast(Tensor, dtensor.from_local(local, param.device_mesh, param.placements, **layout))


def _describe(code: float, what: str) -> str:
    return _WHERE[int(code) % len(_WHERE)].format(m=int(code) // len(_WHERE), what=what)


def _restore(module: Any, fsdp: bool, own: bool, hook: Any) -> None:
    hook.remove()  # and the module's own sync setting back
    if fsdp:
        module.set_requires_gradient_sync(own)
    else:
        module.require_backward_grad_sync = own


def _drop_fsdp_pending(module: nn.Module) -> None:
    """Drop the unsharded gradients FSDP2 holds back inside a window (``opt.discard()``), or
    they would be reduced into the next one (private API: ``tests/test_torch_private_api.py``)."""
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", lambda: None)()  # None: not an FSDP2 module
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [getattr(state, "_fsdp_param_group", None)]
        for fsdp_param in [p for group in groups if group is not None for p in group.fsdp_params]:
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

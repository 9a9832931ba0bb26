"""Every cross-rank decision and collective of accumopt: DDP and FSDP2.

DDP: micro-steps inside a window run without gradient sync (``require_backward_grad_sync``,
what ``no_sync()`` sets); the closing one syncs, overlapped with its backward: one all-reduce
per update. A window in items, or finished micro-steps in the window buffer (not in ``.grad``,
where DDP's reducer looks): accumopt all-reduces the window's gradient once at the boundary.
Items are summed over the ranks (weighted windows are the mean over all ranks' items). FSDP2
likewise via ``set_requires_gradient_sync``; ``reduce_every_micro_step=True`` syncs every one.

Agreement: each per-rank decision that changes the window is agreed before it takes effect,
on accumopt's own gloo group (never paired with DDP's buckets, FSDP2's reduce-scatters or a
gradient sum: a size mismatch aborts gloo; the model's group if that is not the world), by an
all-gather of 3 float64 per rank: data and *position* (what, at which micro-step). Ranks at
different positions (micro-step counts, ``flush()`` on some ranks or with different pending
micro-steps) raise one RuntimeError on every rank before the window is applied; a rank that
never arrives, the group's timeout. Cost per update: one small collective (weighted in
micro-steps: the item sum carries the check; unweighted: one check, run at the forward of a
closing micro-step DDP/FSDP2 syncs, before its buckets; in items: the per-micro-step sums,
plus one at ``flush()``); ``scaler.step``: one per micro-step (the inf/NaN flag, a host sync).
With ``reduce_every_micro_step=True`` a rank flushing alone meets the timeout.

The module's own sync setting (read when the wrapper is built; FSDP2's taken as on) comes back
at :meth:`GradSync.release` (``flush()``, ``discard()``) and when the wrapper is dropped
(``weakref.finalize``): the next window's first micro-step is then synced by DDP/FSDP2 itself
(one extra sync per release, exact: sums commute).

``torch.distributed.fsdp`` is imported only once the user's program imported it: cheap import.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from accumopt import _fsdp_pending, _grads, _refusals
from accumopt._window import Window
from accumopt._window_buffer import WindowBuffer


def _is_fsdp(module: nn.Module | None) -> bool:
    if module is None or "torch.distributed.fsdp" not in sys.modules:
        return False  # nobody imported FSDP2, so no module is one
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def is_distributed(module: nn.Module | None) -> bool:
    """Whether ``module`` synchronises gradients across ranks (DDP, or an FSDP2 root)."""
    return isinstance(module, nn.parallel.DistributedDataParallel) or _is_fsdp(module)


# Positions in the window, stamped on every small collective (see the module docstring)
_ITEMS, _CLOSE, _FLUSH, _BEFORE_CLOSE, _FOUND_INF, _FAILED, _ROWS = range(7)
_SIDE: dict[tuple[int, ...], tuple[object, Any]] = {}  # ranks -> (world group, agreement group)


def _agreement_group(group: Any) -> Any:
    """accumopt's own gloo group over ``group``'s ranks (cached), or ``group`` itself where it
    is not the whole world (creating a group is a collective of every process)."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
    if len(ranks) != dist.get_world_size():
        return group
    cached = _SIDE.get(ranks)
    if cached is not None and cached[0] is world:
        return cached[1]
    try:  # the world's timeout (private API)
        timeout = world._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        timeout = None
    side = dist.new_group(backend="gloo", timeout=timeout)
    _SIDE[ranks] = (world, side)
    return side


def _restore(module: nn.Module, fsdp: bool, own: bool, hook: Any) -> None:
    """Give ``module`` its own sync setting back; remove accumopt's forward pre-hook."""
    hook.remove()
    if fsdp:
        module.set_requires_gradient_sync(own)  # type: ignore[operator]
    else:
        setattr(module, "require_backward_grad_sync", own)  # noqa: B010


def _before_forward(ref: weakref.ref[GradSync]) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        sync = ref()  # a weak reference: the module must not keep a dropped wrapper's sync
        if sync is not None:
            sync.before_forward()

    return hook


class LocalSync:
    """The single-process stand-in for :class:`GradSync`: one rank, no collective."""

    fsdp, rank, world_size = False, 0, 1

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to synchronise, sum, give back or adjust in one process."""

    plan_next = settle_items = release = restored = _nothing

    def check_weighted(self) -> None:
        """Items are this process's own: refused where several ranks train, with no DDP/FSDP2
        model to sum their items through."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(_refusals.items_without_model(dist.get_world_size()))

    def grad_writes(self, micro_steps: int) -> int:
        """In-place writes into ``.grad`` besides accumulation (a DDP model not given)."""
        return micro_steps if dist.is_available() and dist.is_initialized() else 0

    def counted(self, items: float | None, window: Window) -> float | None:
        """The item count of a micro-step is this process's own."""
        return items

    def agreed_found_inf(self, scaler: object, opt: object, found_inf: Tensor) -> Tensor:
        """One process: its own inf/NaN flag."""
        return found_inf

    def close(
        self, buffer: WindowBuffer, params: list[Tensor], divisor: float | None, grads: Any
    ) -> None:
        """Form the window's gradient in ``.grad`` (``grads``: see ``WindowBuffer.close``)."""
        buffer.close(params, divisor, grads)


def sync_for(
    model: nn.Module | None, device: torch.device, reduce_every_micro_step: bool
) -> GradSync | LocalSync:
    """A :class:`GradSync` for a DDP/FSDP2 model, else a :class:`LocalSync`."""
    if is_distributed(model):
        assert model is not None
        return GradSync(model, device, reduce_every_micro_step)
    return LocalSync()


class GradSync:
    """A DDP or FSDP2 model's gradient synchronisation, and every collective accumopt issues.

    Args:
        module: a DDP model, or the root of a ``fully_shard``-ed (FSDP2) model.
        device: where the gradient collectives' tensors live (the wrapped parameters' device).
        reduce_every_micro_step: synchronise every micro-step, not only the closing one.

    Attributes:
        fsdp (bool): ``module`` is FSDP2 (sharded gradients: only its reduce-scatter combines).
        rank, world_size (int): this process's rank in the process group, and its ranks.
        all_reduces (int): accumopt's own collectives that carry data (item sums, gradient
            sums, inf/NaN flags, the runner's agreements); not DDP's or FSDP2's.
        checks (int): small collectives that only check that the ranks agree on the window.
        synced (bool): whether DDP/FSDP2 synchronised the last counted backward pass.

    Raises:
        TypeError: ``module`` is neither.
    """

    def __init__(
        self, module: nn.Module, device: torch.device, reduce_every_micro_step: bool = False
    ) -> None:
        self.fsdp = _is_fsdp(module)
        if not is_distributed(module):
            raise TypeError(
                f"Accumulate: model is a {type(module).__qualname__}; expected the DDP model (or "
                "the fully_shard-ed FSDP2 root) whose parameters the inner optimizer holds."
            )
        self.module = module
        self.device = device
        self.reduce_every_micro_step = reduce_every_micro_step
        self.group: dist.ProcessGroup | None = (
            None if self.fsdp else module.process_group  # type: ignore[assignment]
        )
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.side = _agreement_group(self.group)
        self.all_reduces, self.checks, self.synced = 0, 0, False
        self._enabled = True  # FSDP2's default (it has no public getter)
        own = self._own = self._enabled if self.fsdp else bool(module.require_backward_grad_sync)
        self._released = False  # the module's own setting is in force until a micro-step
        self._planned = own  # the sync setting plan_next chose for the next pass
        self._window: Window | None = None
        self._closing_planned = self._checked_before = self._closing_checked = False
        hook = module.register_forward_pre_hook(_before_forward(weakref.ref(self)), prepend=True)
        # restores the setting when the wrapper (its only owner) is dropped; no reference to self
        self._finalizer = weakref.finalize(self, _restore, module, self.fsdp, own, hook)
        self._finalizer.atexit = False

    def check_fsdp(self, every: object, scaler: object, buffer_all: bool) -> None:
        """FSDP2 gradients are sharded: only FSDP2's own reduce-scatter can combine them."""
        if not self.fsdp:
            return
        problem = None
        if every is None and not self.reduce_every_micro_step:
            problem = "every_items without reduce_every_micro_step=True (the boundary is not "
            problem += "known before the closing micro-step's backward)"
        elif scaler is not None:
            problem = "a GradScaler"
        elif buffer_all:
            problem = "the window buffer (buffer=True or a per-micro-batch nonfinite policy)"
        if problem is not None:
            raise ValueError(
                f"Accumulate: an FSDP2 model with {problem} is not supported; expected "
                "every=N (or reduce_every_micro_step=True), no scaler and buffer=None."
            )

    @property
    def enabled(self) -> bool:
        """Whether the next (or the running) backward pass synchronises gradients."""
        if self.fsdp:
            return self._enabled
        return bool(self.module.require_backward_grad_sync)

    def set_sync(self, enabled: bool) -> None:
        """Let (True) or stop (False) the next backward pass's gradient sync."""
        if self.fsdp:
            if enabled != self._enabled:
                self.module.set_requires_gradient_sync(enabled)  # type: ignore[operator]
                self._enabled = enabled
        else:
            setattr(self.module, "require_backward_grad_sync", enabled)  # noqa: B010

    def plan_next(
        self, window: Window, buffer: WindowBuffer, param_groups: list[dict[str, Any]]
    ) -> None:
        """Sync the next backward pass only if it closes the window and every finished
        micro-step is in ``.grad`` (else accumopt reduces the window); after :meth:`release`,
        an empty window keeps the module's own setting."""
        self._window, self._plan_args = window, (buffer, param_groups)
        self._checked_before = self._checked_before and window.micro_step > 0
        self._released = self._released and window.micro_step == 0 and not window.closed
        self._closing_planned = False
        if self._released:
            self._planned = self._own
        elif self.reduce_every_micro_step:
            self._planned = True
        else:
            grad_only = buffer.grad_only(_grads.params_of(param_groups))
            self._closing_planned = grad_only and window.next_closes()
            self._planned = self._closing_planned
        self.set_sync(self._planned)

    def before_forward(self) -> None:
        """Before each forward: the planned sync setting again (a ``no_sync()`` exit restores
        an old one; released: the module's own); the ranks agree before a closing forward. A
        window schedule that has not answered is asked now, and the pass planned anew."""
        window = self._window
        if window is not None and window.size_error is not None and window.answered():
            self.plan_next(window, *self._plan_args)
        if not self._released:
            self.set_sync(self._planned)
        if window is None or not self._closing_planned or self._checked_before:
            return
        if torch.is_grad_enabled() and not window.closed:
            self._checked_before = True
            self._agree(_BEFORE_CLOSE, window.micro_step, check_only=True)

    def release(self, window: Window, flushing: bool = False) -> None:
        """``flush()``/``discard()``: the module's own sync setting until the next micro-step
        (``flush()`` of an empty window: every rank's is empty; FSDP2: see _fsdp_pending)."""
        if flushing and window.micro_step == 0:
            self._agree(_FLUSH, 0, check_only=True)
        elif self.fsdp and flushing and not (window.closed or self.reduce_every_micro_step):
            raise RuntimeError(_fsdp_pending.FLUSH_UNSUPPORTED.format(steps=window.micro_step))
        elif self.fsdp and not flushing:
            _fsdp_pending.drop_pending(self.module)
        self._released, self._closing_planned = True, False
        self.set_sync(self._own)

    def check_weighted(self) -> None:
        """Items are summed over the ranks: always possible."""

    def grad_writes(self, micro_steps: int) -> int:
        """DDP's reducer copies the all-reduced buckets back after each synced pass."""
        return micro_steps if self.reduce_every_micro_step else 1

    def counted(self, items: float | None, window: Window) -> float | None:
        """A micro-step was counted (remember if it was synced): its items over the ranks for
        a window in items (one small collective), else this rank's own (see settle_items)."""
        self.synced = self.enabled
        self._released = False
        self._closing_checked = self._checked_before and self._closing_planned
        self._checked_before = False
        if items is None or window.every is not None:
            return items
        return self._agree(_ITEMS, window.micro_step + 1, items)[0]

    def restored(self, window: Window, items_global: bool) -> None:
        """A window was loaded: none of its passes was synced (unless all are); items saved
        summed over the ranks (formats 1-2) are kept by rank 0 alone, for the boundary's sum."""
        self.synced = self.reduce_every_micro_step
        self._released = self._checked_before = self._closing_checked = False
        in_steps = window.weighted and window.every is not None
        if items_global and in_steps and self.rank != 0:
            window.items = 0.0

    def agreed_found_inf(self, scaler: object, opt: Any, found_inf: Tensor) -> Tensor:
        """Under ``scaler.step(opt)``: an inf/NaN seen by any rank, on every rank and in the
        scaler's record (one small collective): the same windows skipped, one loss scale."""
        states = scaler._per_optimizer_states  # type: ignore[attr-defined]
        flags: list[Tensor] = list(states[id(opt)]["found_inf_per_device"].values())
        own = sum(float(f.item()) for f in flags)  # WindowBuffer.inf_flag recorded at least one
        found = self._agree(_FOUND_INF, opt._window.micro_step, own)[0] > 0
        for flag in flags:
            flag.fill_(float(found))
        return found_inf.new_full((), float(found))

    def settle_items(self, window: Window) -> None:
        """At the boundary or a ``flush()``: check that every rank closes at this micro-step
        (summing a weighted window's items in the same collective); not where agreed already
        (a window in items that filled up, a closing micro-step checked at its forward)."""
        full, checked = window.full(), self._closing_checked
        self._closing_checked = False
        where = _CLOSE if full else _FLUSH
        if window.weighted and window.every is not None:
            window.items = self._agree(where, window.micro_step, window.items)[0]
        elif not full or not (window.every is None or checked):
            self._agree(where, window.micro_step, check_only=True)

    def _agree(
        self, where: int, micro_step: int, a: float = 0.0, b: float = 0.0, check_only: bool = False
    ) -> tuple[float, float]:
        """Sum ``(a, b)`` over the ranks in rank order (one all-gather of 3 float64 per rank);
        RuntimeError on every rank unless all are at this position, or after a timeout."""
        code = float(micro_step * len(_refusals.WHERE) + where)
        mine = torch.tensor([a, b, code], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, mine, group=self.side)
        except RuntimeError as err:
            raise RuntimeError(_refusals.not_joined(code, err)) from err
        if check_only:
            self.checks += 1
        else:
            self.all_reduces += 1
        rows = [p.tolist() for p in parts]
        if any(r[2] != code for r in rows):
            raise RuntimeError(_refusals.ranks_apart([r[2] for r in rows]))
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    def close(
        self, buffer: WindowBuffer, params: list[Tensor], divisor: float | None, _: object
    ) -> None:
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
        """Sum every dense gradient over the ranks, in place, in one flattened all-reduce per
        (device, dtype). All ranks must pass gradients of the same shapes in the same order."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            if g.is_sparse:
                raise RuntimeError(_refusals.SPARSE_ACROSS_RANKS)
            groups.setdefault((g.device, g.dtype), []).append(g)
        for tensors in groups.values():
            flat = _flatten_dense_tensors(tensors)  # type: ignore[no-untyped-call]
            dist.all_reduce(flat, group=self.group)
            self.all_reduces += 1
            pieces = _unflatten_dense_tensors(flat, tensors)  # type: ignore[no-untyped-call]
            for g, reduced in zip(tensors, pieces):
                g.copy_(reduced)

    def failed_ranks(self, failed: bool) -> float:
        """How many ranks report a failed micro-batch (one all-reduce): all ranks then drop
        or all count it, so nobody waits in a collective another rank never reaches."""
        return self._agree(_FAILED, 0, float(failed))[0]

    def check_same_rows(self, rows: int, api: str) -> None:
        """Refuse batches whose row counts differ across ranks (one small collective): the
        ranks must cut them the same way, or their collectives would not pair up."""
        total, squares = self._agree(_ROWS, 0, float(rows), float(rows * rows))
        if squares * self.world_size != total * total:  # equal on every rank
            raise ValueError(
                f"{api}: this rank's batch has {rows} rows, the ranks' batches {total:g} "
                "together; expected the same number of rows on every rank with "
                "micro_batch_size='auto' under torch.distributed (all ranks back off together)."
            )

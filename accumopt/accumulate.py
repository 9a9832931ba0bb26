"""Gradient accumulation as an optimizer wrapper: ``Accumulate(optimizer, every=N)``.

The wrapper counts backward passes itself, lets gradients accumulate in ``.grad`` (no copy, no
extra memory), and at the accumulation boundary divides the accumulated sum once: by the number
of backward passes (mean of the micro-batch losses), by the total item count handed to
:meth:`AccumulatingOptimizer.backward` (exact per-sample / per-token mean, no look-ahead), or not
at all (``reduction="sum"``). Only then does the inner optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from accumopt import _checks, _grads
from accumopt._backward_counter import BackwardCounter
from accumopt._window_buffer import WindowBuffer
from accumopt.distributed import GradSync, is_distributed

_STATE_KEY = "accumopt"
_PER_MICRO_BATCH = ("skip_micro_batch", "raise")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class AccumulatingOptimizer(torch.optim.Optimizer):
    """Wrap any ``torch.optim.Optimizer`` so that it steps once per window of micro-batches.

    The training loop keeps its usual shape::

        opt = Accumulate(torch.optim.AdamW(model.parameters(), lr=3e-4), every=8)
        for x, y in loader:                      # micro-batches
            F.cross_entropy(model(x), y).backward()
            opt.step()        # the inner optimizer steps on every 8th backward pass only
            if opt.did_update:
                scheduler.step()
            opt.zero_grad()   # clears .grad only after a real step

    **Counting.** Every backward pass that accumulates a gradient into one of the wrapped
    parameters is one *micro-step* (counted by post-accumulate-grad hooks, or with ``model=`` by
    hooks on the model's outputs, and an end-of-backward callback; ``torch.autograd.grad`` is
    not counted). A backward pass that fails part-way pauses counting until :meth:`discard` or
    :meth:`drop_micro_step` drops its partial gradient. The window closes at the end of the
    backward pass that completes it, and ``.grad`` then already holds the window's gradient
    (the mean, see below), so code that inspects or clips gradients before :meth:`step` sees
    what it would see without accumulation; :attr:`will_update` tells whether the next
    :meth:`step` really steps.

    **Averaging.** With plain ``loss.backward()`` of a per-micro-batch *mean* loss, the window's
    gradient is the mean over its micro-steps (equal to the full-batch gradient when the
    micro-batches have equal size). With ``opt.backward(loss_sum, items=n)`` the window's
    gradient is the accumulated sum divided by the total item count of the window, computed
    once at the boundary: exact for ragged batches and variable-length sequences, without
    prefetching the window. ``reduction="sum"`` keeps the plain sum. A weighted window whose
    total item count is 0 changes nothing: no inner step, no NaN, gradients cleared.

    **Hooks.** Step hooks registered on the wrapper run on every micro-step; hooks on
    ``opt.optimizer`` run once per real update; global optimizer hooks see both.

    **AMP.** Pass the ``GradScaler`` (``scaler=``) and keep torch's loop,
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``, on every micro-step.
    Each micro-step's gradient is unscaled with the scale it was computed under and added to
    a window buffer, so a loss-scale change inside the window cannot mix scales; the window is
    skipped when any of its micro-steps had an inf/NaN. At the boundary ``.grad`` holds the
    window mean multiplied by the current loss scale, exactly what ``scaler.unscale_(opt)``
    expects. Gating ``scaler.step``/``scaler.update`` on the boundary (PyTorch's AMP recipe)
    works too.

    Args:
        optimizer: the inner optimizer; any ``torch.optim.Optimizer`` except closure-driven ones
            (LBFGS). The wrapper shares its ``param_groups``, ``state`` and ``defaults``
            objects, so LR schedulers, ``clip_grad_norm_`` and checkpoints work unchanged.
        every: backward passes (micro-steps) per update, an int >= 1.
        every_items: alternatively, items (samples or tokens, as passed to :meth:`backward`) per
            update; the window closes at the first micro-step whose running total reaches it,
            so a micro-batch size that changes during training keeps the effective batch.
            Exactly one of ``every`` and ``every_items`` is given.
        reduction: ``"mean"`` (default) or ``"sum"`` (padertorch's summed gradients).
        max_grad_norm: if set, ``torch.nn.utils.clip_grad_norm_`` is applied to the window's
            (unscaled) gradient once, right before the inner step.
        scaler: the ``torch.amp.GradScaler`` that the loop calls ``scaler.step(opt)`` with.
        buffer: where finished micro-steps are summed. ``None`` (default): bf16/fp16
            parameters are summed in a float32 window buffer (their low-precision ``.grad`` is
            released after each micro-step), other parameters accumulate in ``.grad`` at no
            cost. ``True``: every parameter goes through the buffer (what OOM rollback and the
            per-micro-batch non-finite policies need; they turn it on themselves). ``False``:
            never (low-precision sums then lose precision as the window grows). The buffer
            costs 4 bytes per element (8 for float64 parameters) while a window is open.
        nonfinite: what to do with a micro-batch whose gradient holds an inf or NaN.
            ``None`` (default): nothing is checked (no cost; under AMP the ``GradScaler``
            still skips such windows). ``"skip_window"``: check once at the boundary, skip
            the update (as ``GradScaler`` does). ``"skip_micro_batch"``: drop that micro-batch
            alone and do not count it or its items (optax ``skip_not_finite``, Keras'
            ``LossScaleOptimizer``). ``"raise"``: drop it and raise ``FloatingPointError``
            naming the micro-step. The per-micro-batch policies check every backward pass
            (one host sync each) and use the window buffer.
        model: the model whose outputs the losses are computed from (optional; any
            ``nn.Module``). When given, backward passes are counted where they enter the
            tensors that ``model(...)`` returns (one hook per forward call) instead of at every
            parameter (one hook per parameter per backward pass, 0.5-1 us each on a CPU):
            the cheaper way for models with many parameter tensors. A pass through the outputs
            counts when it accumulates into a wrapped parameter (``torch.autograd.grad`` does
            not, as without ``model=``; under FSDP2 every pass through the outputs counts). A
            backward pass that reaches the wrapped parameters only by another way (say, a
            penalty computed from the parameters alone) is not counted, and the next
            :meth:`step` raises; ``opt.backward(loss)`` always counts.
            Under ``torch.distributed`` pass the ``DistributedDataParallel`` model: micro-steps
            inside a window then skip DDP's all-reduce (``no_sync``), and the window's
            gradient is the mean over the micro-steps (or items) of *all* ranks: item counts
            are summed across ranks (one small all-reduce per weighted micro-step), so the
            update equals single-process full-batch training on all ranks' data. With
            ``every=N``, no buffer and no ``GradScaler``, the closing micro-step is synchronised
            by DDP itself (overlapped with its backward); otherwise accumopt sums the window's
            gradient once at the boundary (one flattened ``all_reduce``). Either way: one
            gradient all-reduce per real optimizer step. Every rank must run the same
            micro-steps (a weighted micro-step is a collective). An FSDP2 (``fully_shard``)
            root module works the same way through its ``set_requires_gradient_sync``; its
            gradients being sharded, it needs ``every=N`` (or ``every_items`` with
            ``reduce_every_micro_step=True``) and supports neither the window buffer nor a
            ``GradScaler``.
        reduce_every_micro_step: synchronise every micro-step instead of the closing one
            (FSDP2: reduce-scatter each micro-step so only the sharded sum is kept, when the
            unsharded gradients of a window would not fit; DDP: rarely useful). Exactness is
            the same; communication is ``every`` times higher.

    Attributes:
        optimizer: the inner optimizer.
        micro_step (int): backward passes counted in the open window.
        skipped_micro_steps (int): micro-batches dropped by ``nonfinite="skip_micro_batch"``.
        items (float): items counted in the open window (0.0 for unweighted windows).
        updates (int): inner optimizer steps applied so far.
        did_update (bool): whether the last :meth:`step` or :meth:`flush` applied an update.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, is already wrapped, or is
            LBFGS; ``scaler`` is not a ``GradScaler``.
        ValueError: ``every``/``every_items`` both or neither given, or not positive;
            ``reduction`` not "mean"/"sum"; ``max_grad_norm`` not positive and finite;
            ``nonfinite`` not one of the policies; ``buffer`` not None/True/False.
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` holds none of the optimizer's parameters.

    References:
        Gradient accumulation with a window of micro-steps follows optax ``MultiSteps``;
        per-token normalisation after the fact follows Megatron-LM's
        ``calculate_per_token_loss``; AMP ordering follows PyTorch's AMP examples
        ("Gradient accumulation").
    """

    # GradScaler.step() hands us grad_scale and found_inf instead of unscaling and deciding
    # on its own, so each micro-step can be folded in at the scale it was computed under.
    _step_supports_amp_scaling = True

    micro_step: int
    items: float
    _weighted: bool | None
    _closed: bool
    _found_inf: Tensor | None
    _buffered: list[Tensor] | None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        every: int | None = None,
        *,
        every_items: float | None = None,
        reduction: str = "mean",
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        buffer: bool | None = None,
        nonfinite: str | None = None,
        model: torch.nn.Module | None = None,
        reduce_every_micro_step: bool = False,
    ) -> None:
        inner = _checks.check_optimizer(optimizer)
        self.every, self.every_items = _checks.check_window(every, every_items)
        self.reduction = _checks.check_reduction(reduction)
        self.max_grad_norm = _checks.check_max_grad_norm(max_grad_norm)
        self.scaler = _checks.check_scaler(scaler)
        self.buffer = _checks.check_buffer(buffer)
        self.nonfinite = _checks.check_nonfinite(nonfinite)
        self.model = _checks.check_model(model, inner)
        if self.nonfinite == "raise" and self.scaler is not None:
            raise ValueError(
                "Accumulate: nonfinite='raise' with a GradScaler would raise on every loss-scale "
                "overflow (the scaler backs off only when it sees the inf); expected "
                "nonfinite='skip_micro_batch' or 'skip_window' under AMP."
            )
        if is_distributed(model) and self.nonfinite in _PER_MICRO_BATCH:
            raise ValueError(
                f"Accumulate: nonfinite={nonfinite!r} with model= (torch.distributed) would let "
                "the ranks drop different micro-steps and disagree on the window; expected "
                "nonfinite='skip_window' or None under DDP/FSDP2."
            )
        if self.buffer is False and self.nonfinite in _PER_MICRO_BATCH:
            raise ValueError(
                f"Accumulate: nonfinite={nonfinite!r} drops single micro-batches, which needs the "
                "window buffer, but buffer=False; expected buffer=None or True."
            )
        # Base init on throw-away copies of the groups: it builds the hook registries and the
        # profiling wrapper of step(), without touching the inner optimizer. Then share the
        # inner's containers by identity (schedulers and GradScaler read and write them).
        super().__init__([dict(g) for g in inner.param_groups], inner.defaults)
        self.optimizer = inner
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults
        self.updates = 0
        self.skipped_micro_steps = 0
        self.did_update = False
        self._buffer = WindowBuffer()
        self._sync = GradSync(model) if is_distributed(model) else None  # type: ignore[arg-type]
        self.reduce_every_micro_step = bool(reduce_every_micro_step)
        self._synced = False  # whether DDP's reducer synchronised the last backward pass
        self._buffer_all = self.buffer is True or self.nonfinite in _PER_MICRO_BATCH
        self._drop_at_step = False
        self._defer_commits = False
        self._uncommitted: tuple[bool, float | None] | None = None
        if self._sync is not None and self._sync.fsdp:
            self._check_fsdp()
        self._reset_window()
        self._stepped = True  # no backward pass waits for a step()
        self._pending_items: float | None = None
        self._awaiting_end = False  # inside opt.backward(), until its pass is counted
        fsdp = self._sync is not None and self._sync.fsdp
        self._counter = BackwardCounter(
            self._on_backward_end, self.model, confirm_accumulation=not fsdp
        )
        self._counter.watch(_grads.params_of(self.param_groups))

    # ------------------------------------------------------------------ public properties

    @property
    def will_update(self) -> bool:
        """True once the window is complete: the next :meth:`step` applies the update.

        It becomes True at the end of the backward pass that closes the window, so code
        between that backward and ``step()`` (logging, clipping) can test it. Under AMP the
        update is still skipped if the window saw an inf/NaN gradient (see :attr:`did_update`).
        """
        return self._closed

    # ------------------------------------------------------------------ accumulation

    def backward(self, loss: Tensor, items: float | Tensor | None = None, **kwargs: Any) -> None:
        """Run ``loss.backward(**kwargs)`` as one micro-step, optionally weighted by ``items``.

        Args:
            loss: scalar tensor. With ``items``, the *sum* of the per-item losses of the
                micro-batch (``reduction="sum"`` in the loss function); the window's gradient
                is then the accumulated sum divided by the window's total ``items``. Without
                ``items``, the same as ``loss.backward()``. Under AMP pass
                ``scaler.scale(loss)``. The call is always exactly one micro-step, also when
                the pass reaches no wrapped parameter (with ``model=``: no model output).
            items: how many items (samples, or tokens that carry a loss) ``loss`` covers: a
                Python number or a one-element tensor (read once, one host sync; pass a
                Python number to avoid it). May be 0.
            **kwargs: forwarded to ``Tensor.backward`` (``retain_graph``, ``inputs``...).

        Raises:
            ValueError: ``items`` negative, non-finite, not a number; a window mixes weighted
                and unweighted micro-steps; an ``every_items`` window gets no ``items``.
            RuntimeError: the window is complete and :meth:`step` has not been called yet; or
                an earlier backward pass failed part-way and its partial gradient was not
                dropped (:meth:`discard`, :meth:`drop_micro_step`).
            In every case nothing has been accumulated by the rejected call.
        """
        _checks.check_loss(loss)
        weight = _checks.check_items(items)
        try:
            self._check_micro_step_kind(weighted=weight is not None)
        except (RuntimeError, ValueError) as err:
            raise type(err)(f"{err} Nothing was accumulated by this call.") from None
        self._check_not_paused("backward")
        self._pending_items, self._awaiting_end = weight, True
        try:
            loss.backward(**kwargs)  # type: ignore[no-untyped-call]
            if self._awaiting_end:
                # The loss reached no wrapped parameter (say, a micro-batch without items that
                # carry a loss) or, with model=, none of the model's outputs: it is still one
                # micro-step, its items count, its gradient is zero.
                self._on_backward_end()
        finally:
            self._pending_items, self._awaiting_end = None, False

    def _check_not_paused(self, api: str) -> None:
        """Refuse to go on after a backward pass that died with its gradient in ``.grad``."""
        if self._counter.paused:
            raise RuntimeError(
                f"Accumulate.{api}: an earlier backward pass failed part-way (say, out of "
                "memory) and its partial gradient is still in .grad; expected opt.discard() "
                "(drops the window) or, with the window buffer, opt.drop_micro_step() (drops "
                "that micro-step alone) first. Nothing was changed by this call."
            )

    def _check_micro_step_kind(self, weighted: bool) -> None:
        if self._closed:
            raise RuntimeError(
                f"Accumulate: the window closed after {self.micro_step} micro-step(s) and step() "
                "has not been called since; expected step() after every backward pass (call "
                "opt.step() before the next backward)."
            )
        if self.every_items is not None and not weighted:
            raise ValueError(
                f"Accumulate: this wrapper closes its window every {self.every_items:g} items, "
                "but a backward pass came without an item count; expected "
                "opt.backward(loss_sum, items=n) for every micro-batch."
            )
        if self.micro_step and weighted != self._weighted:
            kinds = ("weighted (opt.backward(loss, items=n))", "unweighted (plain backward)")
            first, now = (kinds[0], kinds[1]) if self._weighted else (kinds[1], kinds[0])
            raise ValueError(
                f"Accumulate: the open window's {self.micro_step} micro-steps are {first}, this "
                f"one is {now}; expected one kind per window, since their gradients are "
                "normalised differently. Use one kind throughout (or flush() the window first)."
            )

    def _on_backward_end(self) -> None:
        """End-of-backward callback: count the micro-step; close the window when it is full."""
        items, self._pending_items, self._awaiting_end = self._pending_items, None, False
        weighted = items is not None
        try:
            self._check_micro_step_kind(weighted)
        except (RuntimeError, ValueError) as err:
            raise type(err)(
                f"{err} This backward pass did not go through opt.backward(), so it could not "
                "be refused before its gradient was added to .grad: call opt.discard() to drop "
                "the window, then fix the loop."
            ) from None
        self._stepped = False
        if self._defer_commits:
            self._uncommitted = (weighted, items)
            return
        self._commit(weighted, items)

    def commit_micro_step(self) -> None:
        """Count the micro-step whose backward pass ended while commits were deferred.

        The micro-batch runner defers commits under ``torch.distributed``: after each
        micro-batch all ranks first agree (one all-reduce) that none ran out of memory, then
        all commit (counting may all-reduce item counts) or all drop their micro-step
        (:meth:`drop_micro_step`), so a rank that failed never leaves the others waiting in a
        collective. Does nothing when no micro-step is pending.
        """
        pending, self._uncommitted = self._uncommitted, None
        if pending is not None:
            self._commit(*pending)

    def _commit(self, weighted: bool, items: float | None) -> None:
        if self.nonfinite in _PER_MICRO_BATCH and self._micro_step_is_nonfinite():
            return
        self._weighted = weighted
        self.micro_step += 1
        if self._sync is not None:
            self._synced = self._sync.enabled
            if items is not None:
                items = self._sync.sum(items, self._device())
        if items is not None:
            self.items += items
        if (self.every is not None and self.micro_step >= self.every) or (
            self.every_items is not None and self.items >= self.every_items
        ):
            self._close_window()
        else:
            if self.scaler is not None and self._loss_scale() is not None:
                self._unfolded += 1  # under AMP, step() folds with its own loss scale
            else:
                self._buffer.fold(self._buffered_params(), None)
            if self._sync is not None:
                self._update_sync()

    def _micro_step_is_nonfinite(self) -> bool:
        """Per-micro-batch policies: drop a micro-step whose fresh gradient is not finite.

        Under PyTorch's gated AMP recipe (no ``scaler.step`` inside the window) the finished
        micro-steps stay in ``.grad`` with this one, so it cannot be told apart: then nothing
        is checked here and the ``GradScaler`` skips the window at the boundary if needed.
        """
        if self._unfolded:
            return False
        grads = _grads.grads_of(_grads.params_of(self.param_groups))
        if not grads or _grads.all_finite(grads):
            return False
        if self.nonfinite == "raise":
            self.drop_micro_step()
            raise FloatingPointError(
                f"Accumulate: the gradient of micro-step {self.micro_step + 1} of the open window "
                "holds an inf or NaN; it was dropped and the window is intact. Check that "
                "micro-batch's inputs and loss, or use nonfinite='skip_micro_batch'."
            )
        self.skipped_micro_steps += 1
        if self._loss_scale() is None:
            self.drop_micro_step()
        else:  # GradScaler.step must still see the inf to back off the scale
            self._drop_at_step = True
        return True

    def drop_micro_step(self) -> None:
        """Drop the gradient of the micro-step in flight, keeping every finished one.

        Sets ``.grad`` to None on every parameter. Exact when the window buffer holds the
        finished micro-steps (``buffer=True``, or after :meth:`enable_rollback`): used after an
        out-of-memory error in a backward pass, or a non-finite micro-batch.

        Raises:
            RuntimeError: finished micro-steps still live in ``.grad`` (no buffer, or a
                ``GradScaler`` loop without ``scaler.step`` since them), or the window is
                already complete.
        """
        if self._closed:
            raise RuntimeError(
                "Accumulate.drop_micro_step: the window is complete and its gradient formed; "
                "expected a micro-step whose backward pass failed or is not yet counted. Call "
                "opt.discard() to drop the whole window."
            )
        if self._unfolded or (self.micro_step and not self._buffer_all):
            raise RuntimeError(
                "Accumulate.drop_micro_step: finished micro-steps of the open window live in "
                ".grad, so the one in flight cannot be dropped alone; expected buffer=True (or "
                "opt.enable_rollback() before the window) and, under a GradScaler, "
                "scaler.step(opt) after every backward pass."
            )
        for p in _grads.params_of(self.param_groups):
            p.grad = None
        self._pending_items = None
        self._counter.rearm()
        if self._uncommitted is not None:
            self._uncommitted = None
            self._stepped = True

    def enable_rollback(self) -> None:
        """Route every parameter through the window buffer from now on (``buffer=True``).

        Gradients already accumulated in ``.grad`` are folded into the buffer first, so this
        may be called mid-window, between micro-steps. ``MicroBatchRunner`` with
        ``micro_batch_size="auto"`` calls it when it is built, so that a micro-batch that runs
        out of memory can be dropped alone.

        Raises:
            RuntimeError: the wrapper was built with ``buffer=False``.
        """
        if self.buffer is False:
            raise RuntimeError(
                "Accumulate.enable_rollback: the wrapper was built with buffer=False; expected "
                "buffer=None or True, so that a failed micro-batch can be dropped alone."
            )
        if self._sync is not None and self._sync.fsdp:
            raise RuntimeError(
                "Accumulate.enable_rollback: the gradients of an FSDP2 model are sharded and "
                "reduce-scattered by FSDP2 itself, so a failed micro-batch cannot be dropped "
                "alone; expected a DDP or single-process model for OOM recovery."
            )
        if not self._buffer_all:
            self._buffer_all, self._buffered = True, None
            if self.micro_step and not self._closed and self._loss_scale() is None:
                self._buffer.fold(_grads.params_of(self.param_groups), None)
            self._update_sync()

    def _buffered_params(self) -> list[Tensor]:
        """The parameters whose micro-steps go to the window buffer (listed once a window)."""
        params = self._buffered
        if params is None:
            params = _grads.params_of(self.param_groups)
            if self.buffer is False:
                params = []
            elif not self._buffer_all:
                params = [p for p in params if p.dtype in _LOW_PRECISION]
            self._buffered = params
        return params

    def _close_window(self) -> None:
        """Turn the window's sum (buffer + ``.grad``) into its gradient, in ``.grad``."""
        self._closed = True
        params = _grads.params_of(self.param_groups)
        scale = self._loss_scale() if self._buffer else None
        divisor = self._divisor()
        if self._sync is None:
            self._buffer.close(params, scale, divisor)
        elif self._synced:  # DDP's reducer averaged the window over the ranks already
            world = self._sync.world_size
            self._buffer.close(params, scale, None if divisor is None else divisor / world)
        else:  # one all-reduce of the whole window's gradient
            self._buffer.close(params, scale, None)
            trainable = [p for p in params if p.requires_grad]
            used = self._sync.any_rank([p.grad is not None for p in trainable], self._device())
            for p in trainable:
                if p.grad is None:  # every rank must reduce the same tensors
                    p.grad = torch.zeros_like(p)
            self._sync.sum_grads([p.grad for p in trainable])  # type: ignore[misc]
            for p, anywhere in zip(trainable, used):
                if not anywhere:  # unused on every rank: no gradient, as in one process
                    p.grad = None
            if divisor is not None and divisor != 1:
                _grads.div_(_grads.grads_of(trainable), divisor)

    def _update_sync(self) -> None:
        """Under DDP, let the reducer synchronise the next backward only if it closes the
        window and nothing of the window lives outside ``.grad``."""
        if self._sync is None:
            return
        if self.reduce_every_micro_step:
            self._sync.set_sync(True)
            return
        native = (
            self.every is not None and not self._buffered_params() and self._loss_scale() is None
        )
        self._sync.set_sync(native and self.micro_step + 1 >= self.every)  # type: ignore[operator]

    def _check_fsdp(self) -> None:
        """FSDP2 gradients are sharded: only FSDP2's own reduce-scatter can combine them."""
        problem = None
        if self.every is None and not self.reduce_every_micro_step:
            problem = "every_items without reduce_every_micro_step=True (the boundary is not "
            problem += "known before the closing micro-step's backward)"
        elif self.scaler is not None:
            problem = "a GradScaler"
        elif self._buffer_all:
            problem = "the window buffer (buffer=True or a per-micro-batch nonfinite policy)"
        if problem is not None:
            raise ValueError(
                f"Accumulate: an FSDP2 model with {problem} is not supported; expected "
                "every=N (or reduce_every_micro_step=True), no scaler and buffer=None."
            )

    def _device(self) -> torch.device:
        return _grads.params_of(self.param_groups)[0].device

    def _divisor(self) -> float | None:
        """What the window's sum (over all ranks) is divided by; None for an empty weighted
        window."""
        if self.reduction == "sum":
            return 1.0
        if self._weighted:
            return self.items if self.items > 0 else None
        world = self._sync.world_size if self._sync is not None else 1
        return float(self.micro_step * world)

    # ------------------------------------------------------------------ AMP folding

    def _loss_scale(self) -> Tensor | None:
        """The scaler's current loss scale as a tensor (no host sync), or None without AMP."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return self.scaler._get_scale_async()

    # ------------------------------------------------------------------ stepping

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Count a micro-step's ``step()``; apply the inner update if the window is complete.

        Before the boundary this does nothing (under AMP it folds the micro-step's gradient
        into the window buffer). At the boundary it clips (``max_grad_norm``), calls the inner
        optimizer's ``step()`` and sets :attr:`did_update`; it then expects ``zero_grad()``.

        Raises:
            TypeError: a ``closure`` was passed (closures are not supported).
            RuntimeError: no backward pass since the last ``step()``; a backward pass failed
                part-way and its partial gradient was not dropped (:meth:`discard`,
                :meth:`drop_micro_step`); called through a ``GradScaler`` by a wrapper built
                without ``scaler=``; or, with an enabled ``scaler=``, called at the boundary
                without going through ``scaler.step``.
        """
        hooks = (
            self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks
        )
        if hooks:
            return self._profiled_step(closure)
        amp = "found_inf" in self.__dict__
        slow = self._closed or self._stepped or self._drop_at_step or closure is not None or amp
        if slow or self._counter.paused:
            return self._step(closure)
        self._stepped, self.did_update = True, False  # a plain micro-step inside the window
        return None

    # Optimizer.__init__ wraps the class's step() in its profiler/hook wrapper unless it is
    # marked as hooked. That wrapper costs ~30 us per call (a record_function scope), a good
    # part of a small model's micro-step; it runs whenever step hooks exist (they run in it),
    # and is skipped otherwise: the inner optimizer's step() keeps its own profiler scope.
    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, closure: None = None) -> None:
        try:
            self._check_step(closure)
        except (TypeError, RuntimeError):
            # GradScaler deletes these only after a step() that returns: a stale grad_scale
            # would be multiplied into the next one.
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        amp = "found_inf" in self.__dict__  # set by GradScaler.step for the duration of step()
        grad_scale: Tensor | None = self.__dict__.get("grad_scale")
        self._stepped = True
        self.did_update = False
        if self._drop_at_step:  # a non-finite micro-batch, kept until GradScaler saw it
            self._drop_at_step = False
            self.drop_micro_step()
            return None
        if amp:
            found_inf: Tensor = self.__dict__["found_inf"]
            self._found_inf = found_inf if self._found_inf is None else self._found_inf + found_inf
        if not self._closed:
            if amp:
                self._buffer.fold(_grads.params_of(self.param_groups), grad_scale)
                self._unfolded = 0
            return None
        if amp and grad_scale is not None:
            _grads.div_(_grads.grads_of(_grads.params_of(self.param_groups)), grad_scale)
        self._finish_window()
        return None

    def _check_step(self, closure: object) -> None:
        if closure is not None:
            raise TypeError(
                "Accumulate.step: closures are not supported (the inner step runs once per "
                "window); expected step() with no argument. Compute the loss outside and call "
                "backward() and step() once per micro-batch."
            )
        self._check_not_paused("step")
        amp = "found_inf" in self.__dict__
        if amp and self.scaler is None:
            raise RuntimeError(
                "Accumulate.step: called through GradScaler.step, but the wrapper was built "
                "without scaler=; expected Accumulate(optimizer, ..., scaler=scaler) so that "
                "each micro-step is unscaled with its own loss scale."
            )
        if self._stepped:
            hint = (
                "Check that the loss depends on the wrapped parameters; parameters that were "
                "frozen when the wrapper was built are counted from the next real zero_grad() "
                "on."
            )
            if self.model is not None:
                hint += (
                    f" With model= a backward pass is counted when it reaches a tensor returned "
                    f"by the {type(self.model).__qualname__} given (in a tuple, list or dict): "
                    "check that the loss is computed from model(...)'s outputs, or use "
                    "opt.backward(loss) for other losses."
                )
            raise RuntimeError(
                "Accumulate.step: no backward pass since the last step(); expected one "
                "backward pass (loss.backward() or opt.backward(loss, items=n)) before each "
                f"step(). ({hint})"
            )
        if self._closed and not amp and self._loss_scale() is not None:
            raise RuntimeError(
                "Accumulate.step: the window is complete but step() was not called through "
                "the GradScaler given as scaler=, so the gradients are still scaled; expected "
                "scaler.step(opt) followed by scaler.update()."
            )

    _profiled_step = torch.optim.Optimizer.profile_hook_step(_step)

    def _finish_window(self) -> None:
        """Step the inner optimizer on the window's gradient (or skip it), then reset."""
        skip = self._divisor() is None
        if self._found_inf is not None:
            skip = skip or bool(self._found_inf.item() > 0)
        elif self.nonfinite == "skip_window" and not skip:
            skip = not _grads.all_finite(_grads.grads_of(_grads.params_of(self.param_groups)))
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            if self.max_grad_norm is not None:
                params = _grads.params_of(self.param_groups)
                torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            self.optimizer.step()
            self.updates += 1
            self.did_update = True
        self._reset_window()

    def flush(self) -> bool:
        """Apply the open, partial window now (e.g. at epoch end), then clear the gradients.

        The update is the mean over what was accumulated (divided by the micro-steps or items
        actually seen, not by ``every``), with the same clipping and AMP handling as a full
        window. Does nothing when no micro-step is pending.

        Returns:
            Whether an update was applied (also in :attr:`did_update`), so ``if opt.flush():
            scheduler.step()`` keeps the schedule on real steps.

        Raises:
            RuntimeError: a backward pass failed part-way and its partial gradient was not
                dropped (:meth:`discard`, :meth:`drop_micro_step`); nothing is changed.
        """
        self._check_not_paused("flush")
        self.did_update = False
        if self.micro_step == 0:
            return False
        if not self._closed:
            self._close_window()
        scale = self._loss_scale()
        if scale is not None:
            found = _grads.unscale_(_grads.grads_of(_grads.params_of(self.param_groups)), scale)
            self._found_inf = found if self._found_inf is None else self._found_inf + found
        self._finish_window()
        self._stepped = True
        self.optimizer.zero_grad(set_to_none=True)
        return self.did_update

    def discard(self) -> None:
        """Drop the open window: clear the gradients and the counters; the inner is untouched.

        Also the way out after a backward pass that failed part-way (say, out of memory): its
        partial gradient went into ``.grad`` and counting is paused until this call (or
        :meth:`drop_micro_step`, which keeps the finished micro-steps when the window buffer
        holds them)."""
        self._counter.rearm()
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()
        self._stepped = True
        self.did_update = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, but only when no window is open (right after a real step).

        Inside a window this is a no-op, so calling it on every micro-step, before or after
        the backward pass, never wipes accumulated gradients. Use :meth:`discard` to drop a
        window on purpose.
        """
        if self.micro_step == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            # once per window: count parameters unfrozen since the last look
            self._counter.watch(_grads.params_of(self.param_groups))
            self._counter.rearm()  # no gradient is left over from a pass that died

    def _reset_window(self) -> None:
        self._buffered = None  # listed again each window: parameter dtypes may change
        self.micro_step = 0
        self.items = 0.0
        self._weighted = None
        self._closed = False
        self._buffer.clear()
        self._found_inf = None
        self._unfolded = 0  # counted micro-steps whose gradient is still in .grad (AMP)
        self._update_sync()

    # ------------------------------------------------------------------ optimizer plumbing

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (and count backward passes through it)."""
        inner = self.__dict__.get("optimizer")
        if inner is None:  # Optimizer.__init__ filling our throw-away copies
            super().add_param_group(param_group)
            return
        inner.add_param_group(param_group)
        self._buffered = None
        self._counter.watch(self.param_groups[-1]["params"])

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus one ``"accumopt"`` entry.

        The entry holds the window settings, the update count and, mid-window, the window
        position, item count and the accumulated gradients (by parameter index, the same
        indexing as ``"state"``), so a run saved mid-window resumes exactly. Tensors are
        referenced, not copied (as in ``torch.optim``): ``copy.deepcopy`` or ``torch.save``
        the dict before training on. A bare ``torch.optim`` optimizer loads it too (the extra
        entry is ignored).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = self.optimizer.state_dict()
        params = _grads.params_of(self.param_groups)
        window = None
        if self.micro_step:
            window = {
                "micro_step": self.micro_step,
                "items": self.items,
                "weighted": self._weighted,
                "closed": self._closed,
                "stepped": self._stepped,
                "grads": {i: p.grad for i, p in enumerate(params) if p.grad is not None},
                "buffer": {
                    i: self._buffer.sums[p] for i, p in enumerate(params) if p in self._buffer.sums
                },
                "buffer_all": self._buffer_all,
                "found_inf": self._found_inf,
                "unfolded": self._unfolded,
            }
        state[_STATE_KEY] = {
            "version": 1,
            "every": self.every,
            "every_items": self.every_items,
            "reduction": self.reduction,
            "updates": self.updates,
            "window": window,
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, or a bare inner-optimizer state dict.

        A bare state dict (no ``"accumopt"`` entry) loads into the inner optimizer and starts
        a fresh window. A mid-window state dict also restores the accumulated gradients into
        ``.grad`` (copied, on each parameter's device and dtype) and the window position.

        Raises:
            ValueError: the state dict holds an open window but was saved with different
                window settings (``every``, ``every_items``, ``reduction``) or a different
                number of parameters. Nothing is changed then.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"Accumulate.load_state_dict: got {type(state_dict).__qualname__}; expected the "
                "dict returned by state_dict() (or by a bare torch.optim optimizer)."
            )
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        extra = state_dict.get(_STATE_KEY)
        params = _grads.params_of(self.param_groups)
        window = extra.get("window") if extra else None
        if extra is not None and window is not None:
            saved = (extra["every"], extra["every_items"], extra["reduction"])
            ours = (self.every, self.every_items, self.reduction)
            if saved != ours:
                raise ValueError(
                    f"Accumulate.load_state_dict: the checkpoint holds an open window saved with "
                    f"(every, every_items, reduction)={saved!r}, this wrapper has {ours!r}; "
                    "expected the same settings to resume mid-window. Rebuild the wrapper with "
                    "the saved settings, or save at an accumulation boundary."
                )
            indices = list(window["grads"]) + list(window["buffer"])
            if indices and max(indices) >= len(params):
                raise ValueError(
                    f"Accumulate.load_state_dict: the checkpoint's window holds a gradient for "
                    f"parameter {max(indices)}, but the optimizer has {len(params)} parameters; "
                    "expected the same model and parameter groups as when it was saved."
                )
        inner_state = {k: v for k, v in state_dict.items() if k != _STATE_KEY}
        self.updates = int(extra["updates"]) if extra else 0
        self.optimizer.load_state_dict(inner_state)
        # torch's load_state_dict installs new group and state containers on the inner
        # optimizer: share the new ones (schedulers built later must reach the inner).
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self._load_window(window, params)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_window(self, window: dict[str, Any] | None, params: list[Tensor]) -> None:
        if self.micro_step:
            self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()
        self._counter.rearm()
        self._stepped = True
        if window is None:
            return
        self.micro_step = int(window["micro_step"])
        self.items = float(window["items"])
        self._weighted = window["weighted"]
        self._closed = bool(window["closed"])
        self._stepped = bool(window["stepped"])
        with torch.no_grad():
            for i, g in window["grads"].items():
                params[i].grad = g.to(device=params[i].device, dtype=params[i].dtype, copy=True)
            for i, b in window["buffer"].items():
                self._buffer.sums[params[i]] = b.to(device=params[i].device, copy=True)
        self._buffer_all = self._buffer_all or bool(window.get("buffer_all", False))
        self._buffered = None
        self._unfolded = int(window.get("unfolded", 0))
        self._update_sync()
        found = window["found_inf"]
        self._found_inf = None if found is None else found.clone()

    def __getstate__(self) -> dict[str, Any]:
        # A whitelist: an LR scheduler patches ``step`` on the instance with a closure over a
        # weakref, which must neither be pickled nor shared by a deep copy.
        params = _grads.params_of(self.param_groups)
        return {
            "optimizer": self.optimizer,
            "every": self.every,
            "every_items": self.every_items,
            "reduction": self.reduction,
            "max_grad_norm": self.max_grad_norm,
            "scaler": self.scaler,
            "buffer": self.buffer,
            "nonfinite": self.nonfinite,
            "buffer_all": self._buffer_all,
            "model": self.model,
            "reduce_every_micro_step": self.reduce_every_micro_step,
            "skipped_micro_steps": self.skipped_micro_steps,
            "updates": self.updates,
            "did_update": self.did_update,
            "window": (
                self.micro_step,
                self.items,
                self._weighted,
                self._closed,
                self._stepped,
                [p.grad for p in params] if self.micro_step else None,
                self._buffer,
                self._found_inf,
                self._unfolded,
            ),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        AccumulatingOptimizer.__init__(
            self,
            state["optimizer"],
            state["every"],
            every_items=state["every_items"],
            reduction=state["reduction"],
            max_grad_norm=state["max_grad_norm"],
            scaler=state["scaler"],
            buffer=state["buffer"],
            nonfinite=state["nonfinite"],
            model=state["model"],
            reduce_every_micro_step=state["reduce_every_micro_step"],
        )
        self._buffer_all, self._buffered = state["buffer_all"], None
        self.skipped_micro_steps = state["skipped_micro_steps"]
        self.updates = state["updates"]
        self.did_update = state["did_update"]
        (
            self.micro_step,
            self.items,
            self._weighted,
            self._closed,
            self._stepped,
            grads,
            self._buffer,
            self._found_inf,
            self._unfolded,
        ) = state["window"]
        if grads is not None:
            for p, g in zip(_grads.params_of(self.param_groups), grads):
                p.grad = g

    def __repr__(self) -> str:
        window = f"every={self.every}" if self.every else f"every_items={self.every_items:g}"
        return f"Accumulate({window}, reduction={self.reduction!r}, optimizer={self.optimizer!r})"


Accumulate = AccumulatingOptimizer
"""Short public name of :class:`AccumulatingOptimizer`."""

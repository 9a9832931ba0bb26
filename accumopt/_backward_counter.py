"""Count backward passes without asking the user for anything.

A hook on every trainable parameter, run just before its gradient is accumulated into
``.grad``, queues one callback on the autograd engine the first time any of them is reached in
a backward pass that will accumulate (``torch._C._will_engine_execute_node`` on the parameter's
``AccumulateGrad`` node: ``torch.autograd.grad``, which accumulates nothing, is not counted);
the engine runs that callback once, when the whole backward pass has finished (the mechanism
DDP and FSDP use to finalise gradient reduction). So ``loss.backward()`` needs no change in
user code. Running before the first accumulation, the hook has paused counting (below) before
anything reaches ``.grad``: a pass that dies at any later point, whatever kills it (an OOM, a
user's hook raising, Ctrl-C), leaves counting paused.

"The first time" is a flag: the first hook call disarms it and queues the callback, the
callback re-arms it. Every other hook call of the pass is one test of the flag, the cheapest
Python a hook can run (each call from the engine costs ~0.4 us before its body, every operation
in it ~0.1-0.2 us more). A pass that dies (an out-of-memory error in the backward pass) never
runs its callback and leaves the flag disarmed: the passes after it are not counted until the
owner re-arms it (:meth:`BackwardCounter.rearm`) when the failure is dealt with, so a partial
gradient cannot slip into a window unnoticed.

Given a model, the counter can instead hook the tensors the model returns (one hook per output
per forward call): cheaper when the model has more than a few dozen parameter tensors.

The hooks hold the callback's owner weakly, and they are removed when the counter is freed: an
optimizer wrapper that is dropped (the last reference to it deleted or rebound) stops counting
at once, without waiting for a garbage collection.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from accumopt._unhooked import Unhooked


class BackwardCounter:
    """Call ``on_end()`` once at the end of each backward pass that accumulates gradients into
    a watched parameter.

    Args:
        on_end: a bound method, called with no arguments from the autograd engine's final
            callback, after every gradient of the backward pass has been accumulated into
            ``.grad``. An exception it raises propagates out of ``loss.backward()``. Its
            object is held weakly.
        module: where to count. ``None``: at the parameters (one hook per watched parameter,
            run on every backward pass that reaches it, before its accumulation). A module: at the
            tensors its forward calls return (one hook per output per call; for a view, on
            its base, whose history an in-place change of the view keeps in the graph); a
            pass through them counts when it will accumulate into a watched
            parameter (see :class:`_Accumulators`), so ``torch.autograd.grad`` and
            ``backward(inputs=...)`` without the parameters are not counted. Outputs are found
            with ``torch.utils._pytree`` (tensors in tuples, lists, dicts and registered
            containers).
        confirm_accumulation: with a module, whether to ask the engine as above. ``False``
            (FSDP2, whose sharded parameters are not in the graph) counts every pass through
            the outputs, ``torch.autograd.grad`` included.

    Attributes:
        unhooked: ``with counter.unhooked:`` the module's forward calls hook no output (see
            :class:`accumopt._unhooked.Unhooked`).

    Caveat:
        Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``)
        runs nested backward passes inside the outer one. They count as part of it once a
        watched tensor outside the checkpointed part has had its gradient; when the nested pass
        comes first (nothing watched after the checkpointed part), it counts on its own and the
        rest of the outer pass once more. Counting at a module's outputs does not see
        parameters used only inside the checkpointed part. Use ``use_reentrant=False``
        (torch's recommended setting).
    """

    def __init__(
        self,
        on_end: Callable[[], None],
        module: nn.Module | None = None,
        *,
        confirm_accumulation: bool = True,
    ) -> None:
        # Holding the bound method would make owner -> counter -> owner a reference cycle,
        # keeping a dropped owner alive (and counting) until the next garbage collection: keep
        # the owner weakly and the plain function.
        owner_ref = weakref.ref(on_end.__self__)  # type: ignore[attr-defined]
        function = on_end.__func__  # type: ignore[attr-defined]
        armed = [True]  # no callback queued for the running pass
        compiled = [""]  # why counting paused: "compiled" (autograd), "thread", "" (a failure)
        queue = Variable._execution_engine.queue_callback
        modules = sys.modules
        confirm = module is not None and confirm_accumulation
        accumulators = _Accumulators() if confirm else None
        self.unhooked = Unhooked()

        # Closures built once: per backward pass they cost one Python call per hooked tensor
        # (a flag test) and two engine callbacks.
        def end() -> None:
            owner = owner_ref()
            if owner is not None:
                # if the owner's bookkeeping raises (a refusal, a KeyboardInterrupt), the pass's
                # gradient is in .grad but not counted: counting stays paused until it is dropped
                function(owner)
            armed[0] = True

        def fire() -> None:
            # Queued by the first gradient of the pass, this callback runs before callbacks
            # queued later in the same pass (DDP's reducer queues its finalisation when the
            # last bucket is ready, and copies the reduced buckets back into .grad there).
            # Re-queue once, so on_end runs after them and sees the final .grad.
            queue(end)

        def hook(_: object) -> None:
            if armed[0]:
                armed[0] = False
                on = _COMPILED_AUTOGRAD in modules and _compiled_autograd_on()
                compiled[0] = "compiled" if on else ""
                if accumulators is None or accumulators.any_will_run():
                    queue(fire)
                else:  # a pass that accumulates nothing (torch.autograd.grad) runs no end()
                    armed[0] = True

        def param_hook(param: Tensor) -> Callable[[Tensor], None]:
            # Runs before the parameter's gradient is accumulated: the first one of a pass
            # disarms before anything reaches .grad, so a pass that dies at any later point
            # (an OOM, a user's hook raising, Ctrl-C) leaves counting paused.
            node = _AccumulateNode(param)

            def on_grad(_: Tensor) -> None:
                if armed[0]:
                    armed[0] = False
                    on = _COMPILED_AUTOGRAD in modules and _compiled_autograd_on()
                    compiled[0] = "compiled" if on else ""
                    if node.will_run():
                        queue(fire)
                    else:  # torch.autograd.grad(loss, params) accumulates nothing
                        armed[0] = True

            return on_grad

        self._hook = hook
        self._param_hook = param_hook
        self._armed = armed
        self._compiled = compiled
        self._accumulators = accumulators
        self._module = module
        self._handles: list[RemovableHandle] = []
        self._watched: set[int] = set()
        self._seen = 0  # parameters in the groups at the last watch_groups()
        self._frozen: list[Tensor] = []  # those of them that did not require grad then
        self._hooked_leaves: set[int] = set()
        self.retired = False  # remove() was called: this counter counts nothing any more
        weakref.finalize(self, _remove_all, self._handles)
        if module is not None:
            self._handles.append(module.register_forward_hook(self._on_forward()))
            self.unhooked.hooked(module, self._handles[-1])

    def watch(self, params: Iterable[Tensor]) -> None:
        """Count backward passes into every parameter of ``params`` that requires grad
        (idempotent per parameter; call again for parameters unfrozen or added since); a no-op
        once :meth:`remove` retired the counter. With a module, a parameter outside it (a
        learned temperature of the loss) is hooked as without one: a pass reaching it alone
        counts, and one that dies after writing its gradient but before the module's outputs
        leaves counting paused."""
        if self.retired:
            return
        inside = set() if self._module is None else set(map(id, self._module.parameters()))
        for p in params:
            if p.requires_grad and id(p) not in self._watched:
                self._watched.add(id(p))
                if id(p) not in inside:  # no module, or a parameter outside it (see below)
                    hook = self._param_hook(p)
                    self._handles.append(p.register_hook(hook))  # type: ignore[no-untyped-call]
                elif self._accumulators is not None:
                    self._accumulators.add(p)

    def watch_groups(self, param_groups: list[dict[str, Any]]) -> None:
        """:meth:`watch` the parameters of ``param_groups``, cheaply when nothing changed: only
        the parameters frozen at the last look are looked at again, unless the groups now hold
        another number of parameters (then all are)."""
        count = sum(len(group["params"]) for group in param_groups)
        if count != self._seen:
            params = [p for group in param_groups for p in group["params"]]
            self.watch(params)
            self._seen, self._frozen = count, [p for p in params if not p.requires_grad]
        elif self._frozen and any(p.requires_grad for p in self._frozen):
            self.watch(self._frozen)
            self._frozen = [p for p in self._frozen if not p.requires_grad]

    def _on_forward(self) -> _OutputHook:
        """The module's forward hook: a counting hook on every output that requires grad."""
        # no reference to self: the module would keep the counter (and its hooks) alive
        hook, handles, hooked_leaves = self._hook, self._handles, self._hooked_leaves
        grad_enabled, unhooked = torch.is_grad_enabled, self.unhooked

        def on_forward(_: nn.Module, __: Any, output: Any) -> None:
            # no graph, nothing to count (eval, no_grad); or a caller that counts itself
            if unhooked.on or not grad_enabled():
                return
            for leaf in (output,) if isinstance(output, Tensor) else pytree.tree_leaves(output):
                if isinstance(leaf, Tensor) and leaf.requires_grad:
                    # an in-place change of a returned view replaces the view's node, not
                    # its base's history
                    target = leaf if leaf._base is None else leaf._base
                    node = target.grad_fn
                    if node is not None and target._backward_hooks is None:
                        # Tensor.register_hook's two steps without its RemovableHandle (a
                        # third of the cost; the hook dies with the tensor). An OrderedDict,
                        # as torch makes it: handles added later keep a weak reference to it
                        # (their ids are >= 0).
                        target._backward_hooks = OrderedDict(((-1, hook),))
                        node._register_hook_dict(target)
                    elif node is not None:  # the tensor has hooks of its own: leave them be
                        node.register_prehook(hook)  # it gets the output grads: one argument
                    elif id(target) not in hooked_leaves:  # a parameter returned as it is
                        hooked_leaves.add(id(target))
                        handles.append(target.register_hook(hook))  # type: ignore[no-untyped-call]

        return _OutputHook(on_forward)

    @property
    def paused(self) -> bool:
        """Whether counting is paused: a backward pass began and never reached its end (it
        died part-way), and nobody re-armed the counter since. Meaningful between passes."""
        return not self._armed[0]

    @property
    def paused_reason(self) -> str:
        """Why counting is paused: ``"compiled"`` (the pass ran under compiled autograd, whose
        graphs run no engine callbacks: unsupported), ``"thread"`` (:meth:`pause` for a second
        thread) or ``""`` (a pass died part-way)."""
        return self._compiled[0] if self.paused else ""

    def pause(self, reason: str) -> bool:
        """Pause counting on purpose (``reason`` as :attr:`paused_reason`) until :meth:`rearm`;
        returns whether it was armed."""
        armed = self._armed[0]
        self._armed[0], self._compiled[0] = False, reason
        return armed

    def rearm(self) -> None:
        """Count the next backward pass again after one that died before its end (its partial
        gradient must have been dropped by then). Call only between backward passes."""
        self._armed[0] = True

    def remove(self) -> None:
        """Remove every hook and retire the counter: it sees no more backward passes, and
        :meth:`watch` adds none (the owner builds a new counter to count again)."""
        self.retired = True
        self.unhooked.forget()
        _remove_all(self._handles)
        self._watched.clear()
        self._seen, self._frozen = 0, []
        self._hooked_leaves.clear()
        if self._accumulators is not None:
            self._accumulators.clear()


class _Accumulators:
    """The watched parameters' ``AccumulateGrad`` nodes, to ask the engine whether the running
    backward pass will accumulate into any of them (``torch._C._will_engine_execute_node``).

    The usual pass answers with the first node asked: the parameter that answered last is
    asked first. A node goes stale when its parameter's data changes dtype or device
    (``model.half()``, ``.to(device)``: torch then gives the parameter a new accumulator): a
    node that says no is refreshed when its parameter's dtype or device differs from what was
    seen, and the first one always (it answered yes last time; a round trip such as
    ``model.float().double()`` leaves dtype and device as they were).
    ``torch.autograd.grad`` taking a parameter as input makes the engine refuse the question:
    such a pass accumulates nothing.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[Tensor, Node, torch.dtype, torch.device]] = []

    def add(self, param: Tensor) -> None:
        """Watch ``param`` (a leaf that requires grad)."""
        self.entries.append((param, get_gradient_edge(param).node, param.dtype, param.device))

    def clear(self) -> None:
        """Forget every parameter."""
        self.entries.clear()

    def any_will_run(self) -> bool:
        """Whether the running backward pass will accumulate into a watched parameter."""
        will_execute = torch._C._will_engine_execute_node
        entries = self.entries
        for i, (param, node, dtype, device) in enumerate(entries):
            if not param.requires_grad:  # frozen since
                continue
            try:
                runs = will_execute(node)
                if not runs and (i == 0 or param.dtype != dtype or param.device != device):
                    entries[i] = (param, get_gradient_edge(param).node, param.dtype, param.device)
                    runs = will_execute(entries[i][1])
            except RuntimeError:  # torch.autograd.grad() taking this parameter as input
                return False
            if runs:
                if i:
                    entries.insert(0, entries.pop(i))
                return True
        return False


class _OutputHook:
    """The forward hook put on the model. A copy of the model (``copy.deepcopy``, pickling, as
    when the wrapper itself is copied) gets an inert hook instead: a copy must not count into
    this counter, and a copied wrapper hooks its own copy of the model."""

    def __init__(self, on_forward: Callable[[nn.Module, Any, Any], None]) -> None:
        self.on_forward = on_forward

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.on_forward(module, args, output)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert_hook, ()


def _inert(*_: Any) -> None:
    """The forward hook a copied model keeps in place of a counting one."""


def _inert_hook() -> Callable[..., None]:
    return _inert


_COMPILED_AUTOGRAD = "torch._dynamo.compiled_autograd"


class _AccumulateNode:
    """A parameter's ``AccumulateGrad`` node, to ask whether the running backward pass will
    accumulate into its ``.grad`` (``torch._C._will_engine_execute_node``; the engine refuses
    the question for ``torch.autograd.grad`` taking the parameter as an input: no). The node is
    looked up once and again only when it answers no (it went stale when ``model.to(...)``
    gave the parameter a new one). The parameter is held weakly: its own hook holds this."""

    def __init__(self, param: Tensor) -> None:
        self.param = weakref.ref(param)
        self.node: Node = get_gradient_edge(param).node

    def will_run(self) -> bool:
        for fresh in (False, True):
            param = self.param()
            if param is None:
                return False
            if fresh:
                self.node = get_gradient_edge(param).node
            try:
                if torch._C._will_engine_execute_node(self.node):
                    return True
            except RuntimeError:  # torch.autograd.grad() taking this parameter as input
                return False
        return False


def _compiled_autograd_on() -> bool:
    """Whether compiled autograd (``torch._dynamo.compiled_autograd``) is on; False without
    importing it when nobody did."""
    module = sys.modules.get(_COMPILED_AUTOGRAD)
    return module is not None and bool(
        module.compiled_autograd_enabled or module.in_compiled_autograd_region
    )


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()

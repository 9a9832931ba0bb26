"""Count backward passes without asking the user for anything.

The first hook of a pass into a watched parameter (a pre-hook on its ``AccumulateGrad`` node, or,
given a model, on the tensors its forward calls return) moves the window's phase to ``PASS`` and
queues an autograd-engine callback that counts the micro-step once the whole pass has finished
(a nested pass, as in reentrant checkpointing, counts with the one around it). A pass that dies
part-way never runs it and leaves ``PASS``: the wrapper's next call sees the partial gradient.
A pass's item count waits in :data:`PENDING` for every wrapper the pass reaches."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from accumopt._state import Phase, State

_BUSY = (Phase.PASS, Phase.BROKEN, Phase.APPLY)  # a pass that finds these does not begin
COMPILED_AUTOGRAD = "the backward pass ran under compiled autograd"


class _Pending:
    """The item count of the next backward pass, for every wrapper it reaches (one per process:
    autograd runs a CUDA pass's hooks on its device's thread), and its wrapper (held weakly)."""

    def __init__(self) -> None:
        self._items: float | Tensor | None = None
        self._owner: weakref.ref[Any] | None = None

    @property
    def items(self) -> float | Tensor | None:
        """The waiting count (None: none, or its wrapper is gone)."""
        owner = self._owner
        return None if owner is None or owner() is None else self._items

    def set(self, items: float | Tensor | None, owner: Any) -> None:
        self._items, self._owner = items, (None if items is None else weakref.ref(owner))

    def clear(self, owner: Any = None) -> None:
        """Forget the count (``owner`` given: only if that wrapper was told it)."""
        told = self._owner
        if told is not None and (owner is None or told() is owner):
            self._items = self._owner = None


PENDING = _Pending()


class _Group:
    """The :class:`MicroStepGroup` whose passes run now (one per process, as :data:`PENDING`)."""

    members: list[Any] | None = None


GROUP = _Group()


class MicroStepGroup:
    """Backward passes run inside ``with group:`` blocks count as one micro-step of each
    wrapper they reach, counted at :meth:`close` (``accumopt.apply`` runs a batch as several
    passes this way). Each wrapper's first pass waits (``HELD``), its later ones join it, and so
    does a pass of another thread that ends meanwhile. ``fail()`` (or an exception out of
    :meth:`close`) leaves the held wrappers BROKEN: ``discard()`` drops their partial batch."""

    def __init__(self) -> None:
        self.members: list[Any] = []

    def __enter__(self) -> MicroStepGroup:
        GROUP.members = self.members
        return self

    def __exit__(self, *_: object) -> None:
        GROUP.members = None

    def close(self) -> None:
        """Count one micro-step of every wrapper the group's passes reached."""
        done = 0
        try:
            for opt in self.members:
                opt.commit()
                done += 1
        finally:
            self.fail(self.members[done + 1 :])

    def fail(self, members: list[Any] | None = None) -> None:
        """Leave the wrappers held by the group (or ``members``) BROKEN."""
        for opt in self.members if members is None else members:
            opt._break("an accumopt.MicroStepGroup (accumopt.apply) failed part-way")


class Counter:
    """Calls ``on_end(before, items)`` (a bound method; its object is held weakly) at the end
    of every backward pass into a watched parameter: ``before`` is the phase the pass found in
    ``state``, ``items`` :data:`PENDING` when it began. With ``module``, passes are counted at the
    tensors its forward calls return, if they will reach a watched parameter (``confirm=False``,
    for FSDP2's sharded parameters outside the graph: always). ``requeue`` (also set while a
    process group exists) ends a pass one callback later, after DDP's reducer wrote ``.grad``.
    ``retired``: :meth:`remove` was called, nothing is counted any more."""

    def __init__(
        self,
        state: State,
        on_end: Callable[[Phase, float | Tensor | None], None],
        module: nn.Module | None = None,
        *,
        confirm: bool = True,
        requeue: bool = False,
    ) -> None:
        owner_ref = weakref.ref(on_end.__self__)  # type: ignore[attr-defined]
        function = on_end.__func__  # type: ignore[attr-defined]
        queue = Variable._execution_engine.queue_callback
        current_node = torch._C._current_autograd_node
        pending = PENDING
        # the pass: the phase it found, its items, whether requeued; and whether to requeue
        found: list[Any] = [Phase.OPEN, None, False, requeue]
        self._found = found
        self._accumulators: list[tuple[Tensor, Node]] | None = None  # watched inside module
        if module is not None and confirm:
            self._accumulators = []
        accumulators = self._accumulators

        def end() -> None:
            node = current_node()
            if node is not None:  # a nested pass ended inside node: count with the outer one
                _at_end_of(node, end)
                return
            if found[3] and not found[2]:
                found[2] = True  # DDP's reducer writes .grad in a callback queued after ours
                queue(end)
                return
            if pending._owner is not None:
                pending.clear()
            owner = owner_ref()
            if owner is not None:
                function(owner, found[0], found[1])

        def begin(*_: Any) -> None:
            phase = state.phase
            if phase in _BUSY:
                return
            found[0], found[1], found[2] = phase, pending.items, False
            state.phase = Phase.PASS
            if not state.micro_step and compiled_autograd_on():  # it runs no engine callback:
                state.broken = COMPILED_AUTOGRAD  # the pass never ends (asked once a window)
            queue(end)

        def begin_at_output(*_: Any) -> None:
            if state.phase not in _BUSY and (accumulators is None or _any_will_run(accumulators)):
                begin()

        self._begin, self._begin_at_output, self._module = begin, begin_at_output, module
        self._handles: list[RemovableHandle] = []
        self._watched: dict[int, tuple[Tensor, Node | None]] = {}
        self._seen = 0  # parameters in the groups at the last watch_groups()
        self._frozen: list[Tensor] = []
        self._hooked_leaves: set[int] = set()
        self.retired = False
        weakref.finalize(self, remove_all, self._handles)
        if module is not None:
            self._handles.append(module.register_forward_hook(_OutputHook(self)))

    @property
    def requeue(self) -> bool:
        return bool(self._found[3])

    @requeue.setter
    def requeue(self, value: bool) -> None:
        self._found[3] = value

    def watch(self, params: Iterable[Tensor]) -> None:
        """Count passes into every parameter of ``params`` that requires grad (idempotent); with
        a module, one outside it (a loss's learned temperature) is hooked as without one."""
        if self.retired:
            return
        inside = set() if self._module is None else set(map(id, self._module.parameters()))
        for p in params:
            if not p.requires_grad or id(p) in self._watched:
                continue
            node = get_gradient_edge(p).node
            self._watched[id(p)] = (p, node)
            if id(p) not in inside:
                self._handles.append(node.register_prehook(self._begin))
            elif self._accumulators is not None:
                self._accumulators.append((p, node))

    def watch_groups(self, param_groups: list[dict[str, Any]]) -> None:
        """:meth:`watch` the parameters of ``param_groups``, cheaply when their number did not
        change (only those frozen at the last look are looked at again). Once a window."""
        count = sum(len(group["params"]) for group in param_groups)
        if count != self._seen:
            params = [p for group in param_groups for p in group["params"]]
            self.watch(params)
            self._seen, self._frozen = count, [p for p in params if not p.requires_grad]
        elif self._frozen and any(p.requires_grad for p in self._frozen):
            self.watch(self._frozen)
            self._frozen = [p for p in self._frozen if not p.requires_grad]

    def refresh(self) -> None:
        """Hook the new ``AccumulateGrad`` node of every watched parameter that got one
        (``model.to(dtype or device)``); this counter keeps the old nodes alive."""
        watched = self._watched.values()
        stale = [p for p, n in watched if p.requires_grad and get_gradient_edge(p).node is not n]
        for p in stale:
            del self._watched[id(p)]
        self.watch(stale)

    def remove(self) -> None:
        """Remove every hook and retire the counter."""
        self.retired = True
        remove_all(self._handles)
        self._watched.clear()
        self._seen, self._frozen = 0, []
        self._hooked_leaves.clear()
        if self._accumulators is not None:
            self._accumulators.clear()


def _at_end_of(node: Node, callback: Callable[[], None]) -> None:
    """Queue ``callback`` on the pass that runs ``node``, once ``node`` has run."""
    fired = [False]

    def after(*_: Any) -> None:
        if not fired[0]:
            fired[0] = True
            Variable._execution_engine.queue_callback(callback)

    node.register_hook(after)


def _any_will_run(entries: list[tuple[Tensor, Node]]) -> bool:
    """Whether the running pass will accumulate into a parameter of ``entries`` (never under
    ``torch.autograd.grad``); the one that does is moved first, to be asked first next time."""
    will_execute = torch._C._will_engine_execute_node
    for i, (param, node) in enumerate(entries):
        if not param.requires_grad:
            continue
        try:
            runs = will_execute(node)
            if not runs:  # stale: model.to(...) gave the parameter a new node
                fresh = get_gradient_edge(param).node
                if fresh is not node:
                    entries[i] = (param, fresh)
                    runs = will_execute(fresh)
        except RuntimeError:  # the engine refuses the question under torch.autograd.grad
            return False
        if runs:
            if i:
                entries.insert(0, entries.pop(i))
            return True
    return False


class _OutputHook:
    """The model's forward hook: a counting hook on every output that requires grad. A copy of
    the model (``copy.deepcopy``, pickling) gets an inert one: it must not count here."""

    def __init__(self, counter: Counter | None) -> None:
        self.counter = None if counter is None else weakref.ref(counter)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        counter = None if self.counter is None else self.counter()
        if counter is None or not torch.is_grad_enabled():
            return
        begin, leaves = counter._begin_at_output, counter._hooked_leaves
        for leaf in (output,) if isinstance(output, Tensor) else pytree.tree_leaves(output):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                # an in-place change of a returned view replaces the view's node only
                target = leaf if leaf._base is None else leaf._base
                node = target.grad_fn
                if node is not None:
                    node.register_prehook(begin)
                elif id(target) not in leaves:  # a parameter returned as it is
                    leaves.add(id(target))
                    counter._handles.append(target.register_hook(begin))  # type: ignore[no-untyped-call]

    def __reduce__(self) -> tuple[type[_OutputHook], tuple[None]]:
        return _OutputHook, (None,)


def distributed() -> bool:
    """Whether a process group exists (a DDP model the wrapper was not given may sync)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def compiled_autograd_on() -> bool:
    """Whether compiled autograd is on (False without importing it when nobody did)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()

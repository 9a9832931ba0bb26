"""Count backward passes without asking the user for anything.

A post-accumulate-grad hook on every trainable parameter queues one callback on the autograd
engine the first time any of them receives a gradient in a backward pass; the engine runs that
callback once, when the whole backward pass has finished (the mechanism DDP and FSDP use to
finalise gradient reduction). So ``loss.backward()`` needs no change in user code, and
``torch.autograd.grad`` (which accumulates nothing) is not counted.

The hooks hold the counter weakly, the counter holds its callback weakly, and the hooks are
removed when the counter is freed: an optimizer wrapper that is dropped (the last reference to
it deleted or rebound) stops counting at once, without waiting for a garbage collection.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle


class BackwardCounter:
    """Call ``on_end()`` once at the end of each backward pass that reaches a watched parameter.

    Args:
        on_end: called with no arguments from the autograd engine's final callback, after every
            gradient of the backward pass has been accumulated into ``.grad``. An exception it
            raises propagates out of ``loss.backward()``.

    Caveat:
        Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``)
        runs nested backward passes, each of which would be counted; use ``use_reentrant=False``
        (torch's recommended setting).
    """

    def __init__(self, on_end: Callable[[], None]) -> None:
        # A bound method would make owner -> counter -> owner a reference cycle, keeping a
        # dropped owner alive (and counting) until the next garbage collection.
        self._on_end = weakref.WeakMethod(on_end)
        self._queued_in = [-1]  # id of the graph task whose end callback is queued
        self._handles: list[RemovableHandle] = []
        self._watched: set[int] = set()
        weakref.finalize(self, _remove_all, self._handles)

    def _hook(self) -> Callable[[Tensor], None]:
        """The hook every watched tensor gets: queue ``on_end`` once per backward pass."""
        # It runs once per parameter per backward pass: keep it to a task-id lookup and a
        # comparison (the state lives in a list shared by all hooks of this counter).
        ref = weakref.ref(self)
        queued_in = self._queued_in
        task_id = torch._C._current_graph_task_id
        queue = Variable._execution_engine.queue_callback

        def hook(_: Tensor) -> None:
            # Keyed by graph task: a backward pass that died (say, out of memory) never runs
            # its callback, and must not stop the next one from being counted.
            task = task_id()
            if queued_in[0] != task:
                counter = ref()
                if counter is not None:
                    queued_in[0] = task
                    queue(counter._fire)

        return hook

    def watch(self, params: Iterable[Tensor]) -> None:
        """Hook every parameter of ``params`` that requires grad (idempotent per parameter)."""
        hook = self._hook()
        for p in params:
            if p.requires_grad and id(p) not in self._watched:
                self._watched.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def watch_outputs(self, module: nn.Module) -> None:
        """Also count backward passes that reach ``module``'s outputs.

        For FSDP2 models: inside a window they keep gradients unsharded and internal, so no
        parameter's ``.grad`` is written and no post-accumulate hook fires. A forward hook
        registers the counting hook on every output tensor that requires grad.
        """
        hook = self._hook()

        def on_forward(_: nn.Module, __: Any, output: Any) -> None:
            for leaf in pytree.tree_leaves(output):
                if isinstance(leaf, Tensor) and leaf.requires_grad:
                    leaf.register_hook(hook)  # type: ignore[no-untyped-call]

        self._handles.append(module.register_forward_hook(on_forward))

    def _fire(self) -> None:
        # Queued by the first gradient of the pass, this callback would run before callbacks
        # queued later in the same pass (DDP's reducer queues its finalisation when the last
        # bucket is ready, and copies the reduced buckets back into .grad there). Re-queue
        # once, so on_end runs after them and sees the final .grad.
        on_end = self._on_end()
        if on_end is not None:
            Variable._execution_engine.queue_callback(on_end)

    def remove(self) -> None:
        """Remove every hook; the counter then sees no more backward passes."""
        _remove_all(self._handles)
        self._watched.clear()


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()

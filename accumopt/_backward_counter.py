"""Count backward passes without asking the user for anything.

A post-accumulate-grad hook on every trainable parameter queues one callback on the autograd
engine the first time any of them receives a gradient in a backward pass; the engine runs that
callback once, when the whole backward pass has finished (the mechanism DDP and FSDP use to
finalise gradient reduction). So ``loss.backward()`` needs no change in user code, and
``torch.autograd.grad`` (which accumulates nothing) is not counted.

Given a model, the counter can instead hook the tensors the model returns (one node pre-hook
per output per forward call): cheaper when the model has more than a few dozen parameter
tensors, since each hook call costs about as much as the next (~0.5-1 us on a CPU).

The hooks hold the callback's owner weakly, and they are removed when the counter is freed: an
optimizer wrapper that is dropped (the last reference to it deleted or rebound) stops counting
at once, without waiting for a garbage collection.
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
        # Holding the bound method would make owner -> counter -> owner a reference cycle,
        # keeping a dropped owner alive (and counting) until the next garbage collection: keep
        # the owner weakly and the plain function.
        owner_ref = weakref.ref(on_end.__self__)  # type: ignore[attr-defined]
        function = on_end.__func__  # type: ignore[attr-defined]
        queued_in = [-1]  # id of the graph task whose end callback is queued
        task_id = torch._C._current_graph_task_id
        queue = Variable._execution_engine.queue_callback

        # Three closures built once; per backward pass they cost one Python call per watched
        # tensor (a task-id lookup and a comparison) and two engine callbacks.
        def end() -> None:
            owner = owner_ref()
            if owner is not None:
                function(owner)

        def fire() -> None:
            # Queued by the first gradient of the pass, this callback runs before callbacks
            # queued later in the same pass (DDP's reducer queues its finalisation when the
            # last bucket is ready, and copies the reduced buckets back into .grad there).
            # Re-queue once, so on_end runs after them and sees the final .grad.
            queue(end)

        def hook(_: object) -> None:
            # Keyed by graph task: a backward pass that died (say, out of memory) never runs
            # its callback, and must not stop the next one from being counted.
            task = task_id()
            if queued_in[0] != task:
                queued_in[0] = task
                queue(fire)

        self._hook = hook
        self._handles: list[RemovableHandle] = []
        self._watched: set[int] = set()
        weakref.finalize(self, _remove_all, self._handles)

    def watch(self, params: Iterable[Tensor]) -> None:
        """Hook every parameter of ``params`` that requires grad (idempotent per parameter)."""
        hook = self._hook
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
        hook = self._hook

        def pre_hook(grad_outputs: Any) -> None:  # a node pre-hook gets the output grads
            hook(grad_outputs)

        def on_forward(_: nn.Module, __: Any, output: Any) -> None:
            for leaf in (output,) if isinstance(output, Tensor) else pytree.tree_leaves(output):
                if isinstance(leaf, Tensor) and leaf.requires_grad:
                    node = leaf.grad_fn
                    if node is None:  # a leaf tensor returned as it is
                        leaf.register_hook(hook)  # type: ignore[no-untyped-call]
                    else:  # cheaper than Tensor.register_hook (no Python hook dict)
                        node.register_prehook(pre_hook)

        self._handles.append(module.register_forward_hook(on_forward))

    def remove(self) -> None:
        """Remove every hook; the counter then sees no more backward passes."""
        _remove_all(self._handles)
        self._watched.clear()


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()

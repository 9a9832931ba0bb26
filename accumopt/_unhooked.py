"""Forward calls whose outputs the backward counter leaves unhooked, for a caller that runs and
counts the backward pass itself (``MicroBatchRunner``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as _module_hooks
from torch.utils.hooks import RemovableHandle


class Unhooked:
    """While :meth:`enter` ... :meth:`exit` lasts (the runner's ``loss_fn``), the module's
    forward calls hook none of their outputs: the caller runs their backward pass itself and
    counts it (``MicroBatchRunner``, through ``Accumulate._backward_here``), which spares the
    output hook and the two engine callbacks per pass. Without a module (counting at the
    parameters) it changes nothing.

    Where the counting hook is the module's only hook of any kind (and no global module hook
    exists), it is also lifted out of ``module._forward_hooks`` (the same dict object, entry
    deleted and put back), so that ``nn.Module.__call__`` takes its fast path (the slow path
    cost the runner about 4 % of its time on the tiny MLP of ``bench/bench_runner.py``). A module
    compiled in place (``module.compile()``) or a ``torch.compile`` wrapper keeps it: its
    compiled code is guarded on the module's hooks. A hook registered on the module meanwhile
    stays, after the counting hook. A module compiled as part of a larger compiled module is
    compiled once for each state (with and without the hook) when it is run both by the
    runner and by a plain loop."""

    __slots__ = ("_key", "_lifted", "_module", "on")

    def __init__(self, module: nn.Module | None = None) -> None:
        self.on = False
        self._module, self._key = module, -1
        self._lifted: Callable[..., Any] | None = None  # the hook while it is lifted

    def watch(self, handle: RemovableHandle) -> None:
        """The counting hook's handle (its key in ``module._forward_hooks``)."""
        self._key = handle.id

    def enter(self) -> None:
        """Stop hooking outputs (lift the hook where that is safe); pair with :meth:`exit` in
        a ``finally`` (an interrupt at any line of this method is undone there)."""
        self.on = True
        module = self._module
        if module is None or not _liftable(module, self._key):
            return
        hooks = module._forward_hooks
        self._lifted = hooks[self._key]
        del hooks[self._key]

    def run(self, function: Callable[[Any], Any], argument: Any) -> Any:
        """``function(argument)`` between :meth:`enter` and :meth:`exit`."""
        try:
            self.enter()
            return function(argument)
        finally:
            self.exit()

    def exit(self) -> None:
        """Hook outputs again: put the lifted hook back, first in line (idempotent; cleared
        only once it is back, so an interrupt here leaves it for the next exit() to restore)."""
        lifted = self._lifted
        if lifted is not None and self._module is not None:
            hooks = self._module._forward_hooks
            if self._key not in hooks:
                hooks[self._key] = lifted
                hooks.move_to_end(self._key, last=False)  # type: ignore[attr-defined]
        self._lifted = None
        self.on = False


def _liftable(module: nn.Module, key: int) -> bool:
    """Whether the counting hook (``key``) is all that sends ``module``'s calls down
    ``nn.Module.__call__``'s slow path, and no compiled code of the module guards on it."""
    hooks = module._forward_hooks
    return (
        len(hooks) == 1
        and key in hooks
        and not module._forward_pre_hooks
        and not module._backward_hooks
        and not module._backward_pre_hooks
        and not _module_hooks._global_forward_hooks
        and not _module_hooks._global_forward_pre_hooks
        and not _module_hooks._global_backward_hooks
        and not _module_hooks._global_backward_pre_hooks
        and module.__dict__.get("_compiled_call_impl") is None
        and "_orig_mod" not in module._modules  # a torch.compile wrapper (OptimizedModule)
    )

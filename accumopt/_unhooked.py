"""``with counter.unhooked:``: the forward passes of a micro-batch whose backward pass the
caller runs and counts itself (``MicroBatchRunner``), without the ``BackwardCounter``'s
counting forward hook."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


class Unhooked:
    """``with counter.unhooked:`` the module's forward calls inside hook none of their outputs:
    the caller runs their backward pass itself and counts it (``MicroBatchRunner``, through
    ``Accumulate._backward_here``), which spares the hook and the two engine callbacks per
    pass. The counting forward hook is also taken out of the module's hook dict for the block
    and put back at its place after it: a module with no other hook then takes torch's fast
    call path (a few microseconds a call). Without a module (counting at the parameters) it
    changes nothing."""

    __slots__ = ("_later", "_module", "_slot", "_taken", "on")

    def __init__(self) -> None:
        self.on = False
        self._module: weakref.ref[nn.Module] | None = None  # no cycle through the module
        self._slot = -1  # the counting hook's key in the module's _forward_hooks
        self._taken: Any = None  # the hook while taken out
        self._later: list[int] = []  # the keys after it then

    def hooked(self, module: nn.Module, handle: RemovableHandle) -> None:
        """The counting hook of ``module`` is registered under ``handle``."""
        self._module, self._slot = weakref.ref(module), handle.id

    def forget(self) -> None:
        """The counting hook was removed: nothing to take out or put back any more."""
        self._module, self._taken = None, None

    def __enter__(self) -> None:
        self.on = True
        module = None if self._module is None else self._module()
        if module is None:
            return
        hooks = module._forward_hooks
        keys = list(hooks)  # usually just ours
        if self._slot in keys:
            self._later = keys[keys.index(self._slot) + 1 :]  # put back before these
            self._taken = hooks.pop(self._slot)

    def __exit__(self, *_: object) -> None:
        self.on = False  # not nested: the runner enters it once per micro-batch
        taken, self._taken = self._taken, None
        module = None if self._module is None else self._module()
        if taken is None or module is None:
            return
        hooks: OrderedDict[int, Any] = module._forward_hooks  # type: ignore[assignment]
        hooks[self._slot] = taken
        for key in self._later:  # back at its place
            if key in hooks:
                hooks.move_to_end(key)
        self._later = []

"""``MicroBatchRunner``'s bookkeeping of one batch: its running totals (the loss sum, the item
count and, with ``return_outputs=True``, the per-row outputs of its micro-batches), and where a
window it opened without the rollback buffer began."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from accumopt import _tree
from accumopt._loss_result import refer
from accumopt._module_state import ModuleState


class Totals:
    """One batch's running loss sum and item count, and its outputs with ``return_outputs``."""

    __slots__ = ("items", "keep", "losses", "outputs", "reference", "sizes")

    def __init__(self, keep: bool) -> None:
        self.keep = keep  # return_outputs
        self.losses: list[Tensor] = []
        self.items = 0.0
        self.outputs: list[Any] = []
        self.sizes: list[int] = []
        # each output leaf the others must join (check_outputs), by path; None: no output yet
        self.reference: dict[str, Any] | None = None

    def add(self, loss: Tensor, items: float, out: Any, rows: int) -> None:
        self.losses.append(loss)
        self.items += items
        if self.keep and out is not None:
            self.outputs.append(out)
            self.sizes.append(rows)
            self.reference = refer(self.reference, out)

    def mark(self) -> tuple[int, float, int]:
        """Where the totals stand, for :meth:`truncate`."""
        return len(self.losses), self.items, len(self.outputs)

    def truncate(self, mark: tuple[int, float, int]) -> None:
        """Forget the micro-batches added since ``mark`` (a window that starts again)."""
        losses, self.items, outputs = mark
        del self.losses[losses:], self.outputs[outputs:], self.sizes[outputs:]
        self.reference = None
        for out in self.outputs:
            self.reference = refer(self.reference, out)

    def result(self) -> Any:
        """The mean loss (detached, of the losses' shape), or ``(mean, outputs)`` with
        ``return_outputs``."""
        losses = self.losses  # n >= 1 rows: at least one micro-batch
        shape = losses[0].shape
        if len(losses) > 1 and all(loss.shape == shape for loss in losses):
            total = torch.stack(losses).sum(0)  # two dispatches, not one per micro-batch
        else:  # one-element losses of other shapes ((), (1,), ...) broadcast
            total = losses[0]
            for loss in losses[1:]:
                total = total + loss
        mean = total / self.items if self.items > 0 else torch.zeros_like(total)
        if not self.keep:
            return mean
        return mean, (_tree.concat(self.outputs, sizes=self.sizes) if self.outputs else None)


@dataclass
class Opened:
    """A window the ``"auto"`` loop opened without the rollback buffer: its first row, the
    totals then (:meth:`Totals.mark`) and the buffers and generators then."""

    offset: int
    mark: tuple[int, float, int]
    state: ModuleState

"""The accumulation window: which micro-steps belong to it, when it closes, what it divides by.

Pure Python state, no tensors and no ``torch.distributed``: the wrapper tells the window about
each counted micro-step (with the item count summed over the ranks, if any) and asks it whether
the window is full and what the window's summed gradient must be divided by. The rules:

- A window is counted in micro-steps (``every=N``: closes at the N-th) or in items
  (``every_items=T``: closes at the first micro-step whose running item total reaches T; a
  micro-batch that overshoots brings all its items in).
- Its micro-steps are of one kind: all *weighted* (``opt.backward(loss_sum, items=n)``) or all
  unweighted (plain ``loss.backward()`` of mean losses). A window in items takes only weighted
  ones.
- The divisor: the window's item total for a weighted window (``None``, "skip the update",
  when that total is 0), the number of micro-steps over all ranks for an unweighted one, 1 for
  ``reduction="sum"``.
- Every counted micro-step waits for its ``step()``; a closed window takes no micro-step until
  ``step()`` (or ``flush()``/``discard()``) has consumed it.
"""

from __future__ import annotations

from typing import Any


class Window:
    """The open window's position, and the rules above.

    Args:
        every: micro-steps per window (int >= 1), or None.
        every_items: items per window (float > 0), or None; exactly one of the two is given
            (validated by the caller).
        reduction: ``"mean"`` or ``"sum"``.

    Attributes:
        micro_step (int): micro-steps counted in the open window.
        items (float): items counted in the open window, over all ranks (0.0 if unweighted).
        weighted (bool | None): the kind of the window's micro-steps; None while it is empty.
        closed (bool): the window is full and waits for ``step()``.
        stepped (bool): no counted micro-step waits for its ``step()``.
    """

    def __init__(self, every: int | None, every_items: float | None, reduction: str) -> None:
        self.every = every
        self.every_items = every_items
        self.reduction = reduction
        self.stepped = True
        self.reset()

    def reset(self) -> None:
        """Open a new, empty window."""
        self.micro_step = 0
        self.items = 0.0
        self.weighted: bool | None = None
        self.closed = False

    def refusal(self, weighted: bool) -> tuple[type[Exception], str] | None:
        """Why a micro-step of this kind cannot join the window now (exception type and
        message), or None when it can."""
        if self.closed:
            return RuntimeError, (
                f"Accumulate: the window closed after {self.micro_step} micro-step(s) and step() "
                "has not been called since; expected step() after every backward pass (call "
                "opt.step() before the next backward)."
            )
        if self.every_items is not None and not weighted:
            return ValueError, (
                f"Accumulate: this wrapper closes its window every {self.every_items:g} items, "
                "but a backward pass came without an item count; expected "
                "opt.backward(loss_sum, items=n) for every micro-batch."
            )
        if self.micro_step and weighted != self.weighted:
            kinds = ("weighted (opt.backward(loss, items=n))", "unweighted (plain backward)")
            first, now = (kinds[0], kinds[1]) if self.weighted else (kinds[1], kinds[0])
            return ValueError, (
                f"Accumulate: the open window's {self.micro_step} micro-steps are {first}, this "
                f"one is {now}; expected one kind per window, since their gradients are "
                "normalised differently. Use one kind throughout (or flush() the window first)."
            )
        return None

    def count(self, items: float | None) -> bool:
        """Count one micro-step (``items``: its item count over all ranks, None if
        unweighted); return whether it fills the window (which is then closed)."""
        self.weighted = items is not None
        self.micro_step += 1
        if items is not None:
            self.items += items
        self.closed = self.full()
        return self.closed

    def full(self) -> bool:
        """Whether the counted micro-steps (or items) reach the window's size."""
        if self.every is not None:
            return self.micro_step >= self.every
        assert self.every_items is not None
        return self.items >= self.every_items

    def next_closes(self) -> bool:
        """Whether the next micro-step surely closes the window (known only for ``every=N``)."""
        return self.every is not None and self.micro_step + 1 >= self.every

    def divisor(self, world_size: int = 1) -> float | None:
        """What the window's sum over all ranks is divided by; None for a weighted window
        without items (its update is skipped)."""
        if self.reduction == "sum":
            return 1.0
        if self.weighted:
            return self.items if self.items > 0 else None
        return float(self.micro_step * world_size)

    # ------------------------------------------------------------------ checkpoints

    def settings(self) -> tuple[int | None, float | None, str]:
        """``(every, every_items, reduction)``: what a checkpoint's window must match."""
        return self.every, self.every_items, self.reduction

    def position(self) -> dict[str, Any]:
        """The open window's position, for a checkpoint."""
        return {
            "micro_step": self.micro_step,
            "items": self.items,
            "weighted": self.weighted,
            "closed": self.closed,
            "stepped": self.stepped,
        }

    def restore(self, position: dict[str, Any]) -> None:
        """Resume at a position from :meth:`position` (validated by the caller)."""
        self.micro_step = int(position["micro_step"])
        self.items = float(position["items"])
        self.weighted = position["weighted"]
        self.closed = bool(position["closed"])
        self.stepped = bool(position["stepped"])

"""Where ``MicroBatchRunner`` cuts a batch at the wrapper's accumulation boundary: a window in
items (``every_items=N``) closes at the micro-step whose running item total reaches N, and a
micro-batch that overshoots brings all its items in. The runner counts one item per row unless
``loss_fn`` says otherwise, so it cuts a micro-batch at the row where the window fills: each
window then holds exactly N rows whatever the micro-batch size, as a window in items promises
(under DDP/FSDP2, where every rank runs the same rows, N rows over the ranks when the number of
ranks divides N, else the next multiple of it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from accumopt import _tree
from accumopt._window import Window


def room(window: Window, ranks: int) -> int | None:
    """Rows per rank that fill the open window in items if each row carries one item (at
    least 1; ``ranks``: the processes whose items the window sums, each running as many rows),
    or None where no cut is made: a window in micro-steps, a closed window (the next
    micro-step is refused), a schedule without a valid size yet (refused too). With items
    other than rows (tokens), a cut there still closes the window when every row carries an
    item or more. The window's items are the same on every rank: so is the cut."""
    if not window.answered():  # asked again first: a size it gave once may be stale
        return None
    size = window.every_items
    if size is None or window.closed:
        return None
    return max(1, math.ceil((size - window.items) / ranks))


def fixed_pieces(
    rows_of: _tree.RowSlicer, size: int, window: Window, ranks: int
) -> Iterator[tuple[Any, int]]:
    """``(piece, rows)`` of ``size`` rows in order (:meth:`_tree.RowSlicer.split`), a piece cut
    again where the window fills inside it (:func:`room`, read as each piece is taken, after
    the micro-steps before it were counted)."""
    offset = 0
    for piece, rows in rows_of.split(size):
        cut = False
        while (fill := room(window, ranks)) is not None and fill < rows:  # a window ends inside
            yield rows_of(offset, offset + fill), fill
            offset, rows, cut = offset + fill, rows - fill, True
        yield (rows_of(offset, offset + rows) if cut else piece), rows
        offset += rows

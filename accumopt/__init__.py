"""accumopt: train with batches far larger than device memory, with the exact full-batch update.

Public names:
    Accumulate: wrap any ``torch.optim.Optimizer`` so that it applies one update per window
        of micro-batches, with the window's exact mean gradient.
    MicroStepGroup: count several backward passes as one micro-step (``accumopt.apply``).
    Phase: where a wrapper's window is (``opt.phase``).
    checkpoint_position: (updates, micro-steps) a wrapper's state dict was saved at.
    MicroBatchRunner: run one large batch as micro-batches through the wrapper; with
        ``micro_batch_size="auto"`` find the largest one that fits and survive OOM.
    NoMicroBatchFits: raised when not even a micro-batch of one row fits.
    is_oom: whether an exception is an out-of-memory error, in any form torch raises it.
    apply: a drop-in for mbp-pytorch's ``@mbp.apply`` decorator, exact and GradScaler-ready.
    micro_split / Piece: split a nested batch into one piece per device, moved straight there.
    PerSample / Broadcast: mark a batch value as cut with the rows, or passed whole to every
        piece (overriding the rule for per-sample lists).
    parallel_backward: forward the pieces on several devices, one exactly weighted backward.
Submodules: ``accumopt.schedules`` (window schedules, adaptive batch), ``accumopt.noise`` (the
gradient noise scale), ``accumopt.batchnorm`` (BatchNorm warning and remedy),
``accumopt.testing`` (simulated out-of-memory errors, gloo ranks).
"""

__version__ = "0.2.0"  # the one source: pyproject.toml reads it (tool.setuptools.dynamic)

from accumopt._checkpoint import checkpoint_position
from accumopt._counting import MicroStepGroup
from accumopt._state import Phase
from accumopt.accumulate import Accumulate
from accumopt.autosize import NoMicroBatchFits
from accumopt.decorator import apply
from accumopt.oom import is_oom
from accumopt.parallel import parallel_backward
from accumopt.runner import MicroBatchRunner
from accumopt.split import Broadcast, PerSample, Piece, micro_split

__all__ = [
    "Accumulate",
    "Broadcast",
    "MicroBatchRunner",
    "MicroStepGroup",
    "NoMicroBatchFits",
    "PerSample",
    "Phase",
    "Piece",
    "__version__",
    "apply",
    "checkpoint_position",
    "is_oom",
    "micro_split",
    "parallel_backward",
]

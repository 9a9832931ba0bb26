"""accumopt: train with batches far larger than device memory, with the exact full-batch update.

``Accumulate`` wraps any ``torch.optim.Optimizer`` so that it applies one update per window of
micro-batches; ``MicroBatchRunner`` runs one large batch through it (``"auto"``: the largest
micro-batch that fits, surviving OOM; ``TokenBudget``: micro-batches cut by their tokens);
``micro_split`` / ``parallel_backward`` / ``apply`` split a batch over micro-batches and
devices. Submodules: ``schedules``, ``noise``, ``batchnorm``,
``testing`` (import them by name); ``integrations`` (Lightning, HF Trainer, Accelerate).
"""

__version__ = "0.2.0"  # the one source: pyproject.toml reads it (tool.setuptools.dynamic)

from accumopt._checkpoint import checkpoint_position
from accumopt._counting import MicroStepGroup
from accumopt._state import Phase
from accumopt.accumulate import Accumulate
from accumopt.autosize import NoMicroBatchFits
from accumopt.budget import TokenBudget
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
    "TokenBudget",
    "__version__",
    "apply",
    "checkpoint_position",
    "is_oom",
    "micro_split",
    "parallel_backward",
]

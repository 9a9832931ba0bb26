"""accumopt: exact gradient accumulation for any PyTorch optimizer.

Public names:
    Accumulate / AccumulatingOptimizer: wrap a ``torch.optim.Optimizer`` so that it applies one
        update per window of micro-batches, with the window's exact mean gradient.
"""

from accumopt.accumulate import Accumulate, AccumulatingOptimizer

__all__ = ["Accumulate", "AccumulatingOptimizer", "__version__"]
__version__ = "0.1.0"

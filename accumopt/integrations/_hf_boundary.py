"""What the Hugging Face Trainer's prepared optimizer steps under :class:`AccumulateTrainer`
(:class:`Boundary`), and where the ``Accumulate`` wrapper is in a wrapped optimizer
(:func:`find`)."""

from __future__ import annotations

from typing import Any

from accumopt.accumulate import AccumulatingOptimizer


class Boundary:
    """What ``AcceleratedOptimizer`` steps: the wrapper, or its flush at the epoch's end
    (``zero_grad``, ``state_dict``, everything else: the wrapper's)."""

    def __init__(self, trainer: Any, opt: AccumulatingOptimizer) -> None:
        self.trainer, self.optimizer = trainer, opt

    def __getattr__(self, name: str) -> Any:  # not during copy/unpickling, before __init__
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def step(self, closure: Any = None) -> None:
        opt, trainer = self.optimizer, self.trainer
        trainer._stepping = True
        try:
            if opt.will_update:
                opt.step()
            elif opt.micro_step > 0:
                opt.flush()  # the epoch's short last window: its own exact mean
        finally:
            trainer._stepping = False
        report = opt.last_window
        if trainer._norm is not None and report is not None and report.grad_norm is not None:
            trainer._norm.copy_(report.grad_norm)


def find(opt: Any) -> AccumulatingOptimizer | None:
    """The ``Accumulate`` in ``opt``, under Accelerate's wrapper and ours, or None."""
    while opt is not None and not isinstance(opt, AccumulatingOptimizer):
        opt = getattr(opt, "optimizer", None)
    return opt

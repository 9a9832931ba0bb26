"""is_oom: out-of-memory errors wrapped by user code are still recognised, others are not."""

from __future__ import annotations

import doctest

import pytest
import torch

import accumopt.oom
from accumopt import Accumulate, MicroBatchRunner, is_oom


def _raise_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        raise outer from inner
    except BaseException as err:
        return err


def _raise_while_handling(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - an implicit __context__ is the point
    except BaseException as err:
        return err


def _cuda_oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_is_oom_finds_an_oom_wrapped_by_user_code() -> None:
    wrapped = _raise_from(RuntimeError("forward of block 3 failed"), _cuda_oom())
    assert is_oom(wrapped)
    # the text form, any wrapper type, raised while handling, and several levels deep
    cpu = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB")
    assert is_oom(_raise_from(ValueError("bad batch"), cpu))
    assert is_oom(_raise_while_handling(KeyError("cleanup failed"), _cuda_oom()))
    deep = _raise_from(TypeError("layer"), _raise_from(RuntimeError("block"), _cuda_oom()))
    assert is_oom(_raise_from(RuntimeError("model"), deep))


def test_is_oom_ignores_unrelated_errors_and_their_chains() -> None:
    shapes = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x5)")
    assert not is_oom(shapes)
    assert not is_oom(_raise_from(RuntimeError("forward of block 3 failed"), shapes))
    assert not is_oom(_raise_while_handling(RuntimeError("retry failed"), ValueError("x")))
    assert not is_oom(ValueError("out of memory"))  # only RuntimeErrors carry the texts
    # `raise ... from None` hides the context, as in the traceback Python prints
    try:
        try:
            raise _cuda_oom()
        except torch.OutOfMemoryError:
            raise RuntimeError("gave up") from None
    except RuntimeError as hidden:
        assert not is_oom(hidden)


def test_is_oom_survives_a_cycle_in_the_chain() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert not is_oom(a)
    c = RuntimeError("c")
    c.__context__ = a
    b.__cause__ = _cuda_oom()  # reachable only through the cycle
    assert is_oom(c)


def test_runner_backs_off_on_a_wrapped_oom() -> None:
    """MicroBatchRunner treats a wrapped OOM as an OOM: it retries smaller, losing no row."""
    model = torch.nn.Linear(2, 1)
    rows: list[int] = []

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        if len(x) > 3:
            try:
                raise _cuda_oom()
            except torch.OutOfMemoryError as oom:
                raise RuntimeError(f"forward of {len(x)} rows failed") from oom
        rows.append(len(x))
        return model(x).sum()

    opt = Accumulate(torch.optim.SGD(model.parameters(), lr=0.1), every_items=10)
    runner = MicroBatchRunner(opt, loss_fn, micro_batch_size="auto", loss_reduction="sum")
    runner(torch.randn(10, 2))
    assert runner.ooms > 0 and sum(rows) == 10 and max(rows) <= 3


def test_docstring_example_runs() -> None:
    assert doctest.testmod(accumopt.oom, raise_on_error=True).attempted >= 4


@pytest.mark.parametrize("error", [RuntimeError("x"), KeyboardInterrupt(), SystemExit(1)])
def test_is_oom_takes_any_exception(error: BaseException) -> None:
    assert not is_oom(error)

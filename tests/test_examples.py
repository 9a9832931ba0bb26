"""The examples run end to end on small settings and report what they promise."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """The examples set torch's thread count (--threads); keep it from leaking into others."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def load(name: str) -> ModuleType:
    torch.set_default_dtype(torch.float32)  # as a user runs them (the fixture restores it)
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_digits_first_window_matches_full_batch_and_trains() -> None:
    out = load("digits").main(["--epochs", "3"])
    assert out["first_window_grad_max_abs_diff"] < 1e-12
    assert out["first_window_max_abs_diff"] < 1e-12
    assert out["updates"] == 9
    assert out["test_accuracy"] > 0.5


@pytest.mark.slow
def test_char_lm_token_weighting_is_exact_and_uniform_is_not() -> None:
    out = load("char_lm").main(["--steps", "10", "--sample-len", "10"])
    assert out["token_weighted_rel_err"] < 1e-12
    assert out["uniform_rel_err"] > 1e-2
    assert out["last_loss"] < out["first_loss"]


@pytest.mark.slow
def test_token_budget_is_exact_and_pads_less_than_a_row_cap() -> None:
    out = load("token_budget").main(["--windows", "4"])
    assert out["max_abs_diff"] < 1e-12
    cap, budget, exact = out["row cap"], out["token budget"], out["exact shapes"]
    assert exact["padding"] < budget["padding"] < cap["padding"]
    assert budget["micro_steps"] < cap["micro_steps"]
    assert budget["shapes"] < exact["shapes"]
    assert abs(budget["loss"] - cap["loss"]) < 1e-3  # the same updates, in float32


@pytest.mark.slow
def test_autosize_digits_oom_recovery_matches_unlimited_run() -> None:
    out = load("autosize_digits").main(["--epochs", "2", "--compare-epochs", "1"])
    assert out["max_abs_param_diff"] < 1e-12
    assert out["compare_ooms"] == 8  # 512, 256, 128, 64, then 48, 44, 42, 41 above the limit 40
    assert out["micro_batch_size"] == 40
    assert out["ooms"] == 8
    assert out["updates"] == 6  # 2 full windows + 1 flushed partial window per epoch
    assert out["test_accuracy"] > 0.5


def test_ddp_example_without_torchrun_says_how_to_launch_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match=r"torchrun --nproc-per-node 2 examples/ddp_digits.py"):
        load("ddp_digits").main([])


def test_docs_runner_snippet_moves_batches_with_device_and_counts_at_the_outputs() -> None:
    # issue 14: the runner moves each micro-batch (pinned, non_blocking) with device=, not a
    # .cuda() inside the loss function; the wrapper under it counts at the model's outputs.
    # The snippet lives in the docs' guide page (it runs there, as every block of the docs).
    page = EXAMPLES.parent / "docs" / "guide" / "one-big-batch.md"
    blocks = page.read_text().split("```python")[1:]
    snippet = next(b.split("```")[0] for b in blocks if "MicroBatchRunner(opt" in b)
    compile(snippet, str(page), "exec")
    assert ".cuda()" not in snippet and "device=" in snippet
    assert "model=model)" in snippet.split("MicroBatchRunner(opt")[0]

"""Collection at the repository root.

- The package's doctests: an integration whose framework is not installed is not imported (its
  tests in ``tests/`` skip with the reason).
- The Python code blocks of ``README.md`` and ``docs/**/*.md`` run as tests (Sybil): the blocks
  of one page share one namespace and run in order, as a reader runs them; an HTML comment
  ``<!-- invisible-code-block: python ... -->`` holds a page's hidden setup (tiny CPU models and
  data), ``<!-- skip: next "reason" -->`` marks a block that needs a GPU or ``torchrun`` (the
  example tests run those paths instead).
- Under pytest-xdist the blocks of one page stay together on one worker, in order.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

_NEEDS = {"lightning": "lightning", "hf_trainer": "transformers", "accelerate": "accelerate"}

collect_ignore = [
    f"accumopt/integrations/{module}.py"
    for module, framework in _NEEDS.items()
    if importlib.util.find_spec(framework) is None
]


def _setup(namespace: dict[str, Any]) -> None:
    """Each page starts as a reader's session would: torch's defaults, a fixed seed."""
    namespace["_saved"] = (torch.get_default_dtype(), torch.get_num_threads())
    torch.manual_seed(0)


def _reset_accelerate() -> None:
    """A Trainer or an Accelerator stopped inside a window leaves Accelerate's process-wide
    state saying that gradients do not sync, which every later wrapper in the process refuses
    (as accumulation around it): each test and page starts from a fresh state."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    yield
    _reset_accelerate()


def _teardown(namespace: dict[str, Any]) -> None:
    """Free the page's wrappers and restore what a page may change. A page whose loop leaves a
    window never applied fails here (as a reader's run would warn), so its blocks flush."""
    dtype, threads = namespace.pop("_saved")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace.clear()
        gc.collect()
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    logging.getLogger("accumopt").setLevel(logging.NOTSET)
    _reset_accelerate()
    unapplied = [str(w.message) for w in caught if "never applied" in str(w.message)]
    assert not unapplied, f"a page ended inside a window: {unapplied}"


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "*.md"],
    setup=_setup,
    teardown=_teardown,
    excludes=["CHANGELOG.md", "RESULTS.md"],
).pytest()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's default ``load`` distribution, except that the blocks of one Markdown page go to
    one worker as a unit (they build on each other)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class PagesTogether(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".md") else nodeid

    return PagesTogether(config, log)

"""Test-wide settings: float64 as the default dtype (exactness is claimed in float64), and
Hypothesis derandomized, so that a test run draws the same examples every time.

``HYPOTHESIS_PROFILE=explore python -m pytest ...`` draws new random examples instead (and
more of them): the way to hunt for new failures, which then become fixed examples
(``@example``) or tolerances that hold for the whole strategy."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    """Exactness is claimed in float64: every test runs with it as the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)

"""Test-wide fixture: exactness is claimed in float64, so every test runs with that default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    """Exactness is claimed in float64: every test runs with it as the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)

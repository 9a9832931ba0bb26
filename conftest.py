"""Collection of the package's doctests: an integration whose framework is not installed is
not imported (its tests in ``tests/`` skip with the reason)."""

from __future__ import annotations

import importlib.util

_NEEDS = {"lightning": "lightning", "hf_trainer": "transformers", "accelerate": "accelerate"}

collect_ignore = [
    f"accumopt/integrations/{module}.py"
    for module, framework in _NEEDS.items()
    if importlib.util.find_spec(framework) is None
]

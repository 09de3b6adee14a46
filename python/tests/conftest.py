"""pytest setup: moe_route comes from PYTHONPATH (the build tree, e.g.
PYTHONPATH=build-py/python), the reference and helpers from this folder."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import moe_route  # noqa: F401
    from moe_route import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - a setup problem, not a test failure
    raise pytest.UsageError(
        "moe_route (with its extension _C) must be importable: run with PYTHONPATH=<build>/python, "
        f"e.g. PYTHONPATH=build-py/python python3 -m pytest python/tests ({exc})")


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same seed, so its inputs (and results) are fixed."""
    torch.manual_seed(1234)
    yield


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(20240601)
    return g

"""The types hold: mypy, configured in pyproject.toml ([tool.mypy]: which modules, how strict),
passes on bus/ and the services' pure cores.

mypy keeps its cache in .mypy_cache/ at the top of the checkout, so after the first run only
the changed modules are checked again.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install '.[test]')")
def test_mypy_passes():
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

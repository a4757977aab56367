"""The code style the project holds itself to (pyproject.toml's ruff rules, the complexity
rule among them), checked with the suite so that it cannot drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install '.[test]')")
def test_ruff_passes():
    result = subprocess.run([RUFF, "check", "bus", "services", "tests", "bench"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]

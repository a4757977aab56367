"""What a process imports before it does its work.

Every `llmbus up` and every service process builds the command line of all services, so a
module-level `import torch` in any service's import chain costs each of them ~1.5 s of CPU at
start (six processes a stack), and in the executor it loads libgomp before `configure_openmp`
has set its waiting policy, which libgomp reads only once, when it loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from llmbus.services.cli import build_parser
build_parser()
import llmbus.services.executor.service
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_the_command_line_and_the_executor_service_load_without_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported at start: {out.stdout.strip()}"


@pytest.mark.parametrize("service", ["api", "tokenizer", "detokenizer", "scheduler"])
def test_a_service_other_than_the_executor_never_needs_torch(service):
    """Its whole module, not only its options: `llmbus serve NAME` imports it to run."""
    code = (f"import sys, importlib; from llmbus.services.cli import SERVICE_MODULES; "
            f"importlib.import_module(SERVICE_MODULES[{service!r}]); "
            f"print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

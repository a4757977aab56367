"""What tests share about a real stack: auth, the default model's name, skipping without it;
the stack itself comes from the bench package (benchmark scripts start it the same way)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmbus.bench.stack import MODEL_NAME, RunningStack, engine_stats, start_stack, stop_stack
from llmbus.services.model_files import default_model_path

__all__ = ["API_KEY", "AUTH", "MODEL_NAME", "REPO", "RunningStack", "engine_stats",
           "needs_default_model", "processes_mentioning", "start_stack", "stop_stack"]

REPO = Path(__file__).resolve().parent.parent
API_KEY = "llmbus-test-key"  # the shared stack requires it, so every test exercises auth
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def needs_default_model() -> pytest.MarkDecorator:
    return pytest.mark.skipif(not default_model_path().is_file(),
                              reason="default model not pulled (`llmbus model pull`)")


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (our children carry the nats URL/port)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids

"""Shared fixtures: a real `llmbus up` stack (real nats-server, real default model)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.launcher import free_port
from services.model_files import default_model_path
from tests.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "smollm2-135m-instruct"
API_KEY = "llmbus-test-key"  # the shared stack requires it, so every test exercises auth
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def needs_default_model() -> pytest.MarkDecorator:
    return pytest.mark.skipif(not default_model_path().is_file(),
                              reason="default model not pulled (`llmbus model pull`)")


@dataclass
class RunningStack:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT/v1
    nats_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_stack(tmp_dir: Path, *extra: str, timeout: float = 240.0,
                env: dict[str, str] | None = None) -> RunningStack:
    """Run `llmbus up` as a user would; return once it prints that it is ready."""
    port = free_port()
    log_path = tmp_dir / f"llmbus-up-{port}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), *extra],
        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        match = re.search(r"llmbus is ready: (\S+) \(nats: ([^;\s)]+)(?:; observer URL in "
                          r"(\S+))?\)", text)
        if match:  # the observer's credentials are in a file the line names, if any
            url = Path(match.group(3)).read_text().strip() if match.group(3) else match.group(2)
            return RunningStack(process, match.group(1), url, log_path)
        if process.poll() is not None:
            raise RuntimeError(f"llmbus up exited with {process.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"llmbus up not ready in {timeout} s:\n{log_path.read_text()[-4000:]}")


def stop_stack(stack: RunningStack, timeout: float = 30.0) -> int:
    if stack.process.poll() is None:
        stack.process.send_signal(signal.SIGTERM)
    return stack.process.wait(timeout)


@pytest.fixture(scope="session")
def otlp() -> OtlpReceiver:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver) -> RunningStack:
    """The shared stack: requires an API key and exports traces to a real OTLP receiver.

    It runs the executor's exact mode, whose greedy output the e2e tests compare with HF
    transformers (design invariant 3); the stacks of the fault, replica and launcher tests run
    the fast default."""
    if not default_model_path().is_file():
        pytest.skip("default model not pulled (`llmbus model pull`)")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    running = start_stack(tmp_path_factory.mktemp("stack"), "--api-key", API_KEY, "--exact",
                          env=env)
    yield running
    stop_stack(running)


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers on the same GGUF: the reference for greedy outputs (test-only)."""
    if not default_model_path().is_file():
        pytest.skip("default model not pulled (`llmbus model pull`)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    return tokenizer, model


def hf_greedy(hf_reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF `generate`, stopping at eos like the server does."""
    import torch

    tokenizer, model = hf_reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()

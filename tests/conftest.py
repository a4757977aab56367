"""Shared fixtures: the session's real `llmbus up` stack (tests/stack.py starts it), an OTLP
receiver for its traces, HF transformers as the greedy reference."""

from __future__ import annotations

import pytest

from llmbus.services.model_files import default_model_path
from tests.otlp_receiver import OtlpReceiver
from tests.stack import API_KEY, RunningStack, start_stack, stop_stack


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

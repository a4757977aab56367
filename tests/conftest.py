"""Shared fixtures: the session's real `llmbus up` stack (tests/stack.py starts it), an OTLP
receiver for its traces, a nats-server per adapter test (`bus`), HF transformers as the greedy
reference. And every test's kind.

Kinds, one per test, given by its file (TEST_KINDS): `unit` (pure code: no nats-server, no
model), `adapter` (a real nats-server, no model) and `e2e` (the default model and/or a whole
stack). A test marked `model` needs the default model, so it is `e2e` whatever its file. A test
file missing from TEST_KINDS stops the run at collection, naming the file.
"""

from __future__ import annotations

from pathlib import Path

import nats
import pytest

from llmbus.services.launcher import Stack
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


@pytest.fixture
async def bus():
    """A nats-server of its own on a free port (adapter tests), and a client of it."""
    stack = Stack()
    url = stack.start_nats(auth=False)
    client = await nats.connect(url)
    try:
        yield url, client
    finally:
        await client.close()
        stack.stop()


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


TESTS = Path(__file__).resolve().parent
# By file name, not path: a file that moves into a subfolder keeps its kind.
TEST_KINDS = {
    # pure code: scheduler, tokenizer and detokenizer cores, messages, executor on tiny files
    "test_bench_serve.py": "unit",
    "test_bus_messages.py": "unit",
    "test_bus_cluster.py": "adapter",
    "test_bus_servers.py": "adapter",
    "test_code_shape.py": "unit",
    "test_constraints.py": "unit",
    "test_cpu_paged_attention.py": "unit",
    "test_detokenizer.py": "unit",
    "test_disaggregation.py": "unit",
    "test_remote_prefills.py": "unit",
    "test_disaggregated_serving.py": "e2e",
    "test_kv_transfer.py": "unit",
    "test_detokenizer_routing.py": "unit",
    "test_engine_loop.py": "unit",
    "test_executor_constraints.py": "unit",
    "test_family_fast_mode.py": "unit",
    "test_executor_model.py": "unit",
    "test_executor_multi_step.py": "unit",
    "test_executor_onnx.py": "unit",
    "test_backend_choice.py": "unit",
    "test_executor_speculative.py": "unit",
    "test_int_step.py": "unit",
    "test_k_quants.py": "unit",
    "test_kv_manager.py": "unit",
    "test_lint.py": "unit",
    "test_model_families.py": "unit",
    "test_migration_rules.py": "unit",
    "test_model_files.py": "unit",
    "test_ngram_proposer.py": "unit",
    "test_packaging.py": "unit",
    "test_pipeline_view.py": "unit",
    "test_prefix_tree.py": "unit",
    "test_reasoning.py": "unit",
    "test_rope_scaling.py": "unit",
    "test_sampler.py": "unit",
    "test_scheduler.py": "unit",
    "test_scheduler_config.py": "unit",
    "test_scheduler_multi_step.py": "unit",
    "test_scheduler_step_time.py": "unit",
    "test_scheduler_prefix_and_fork.py": "unit",
    "test_scheduler_speculation.py": "unit",
    "test_sentencepiece_tokenizer.py": "unit",
    "test_stage_cores.py": "unit",
    "test_tokenizer.py": "unit",
    "test_types.py": "unit",
    # tests/executor/kernels/triton/: Triton kernels against their torch references
    "test_interpreter_setup.py": "unit",
    "test_model_backend.py": "unit",
    "test_paged_decode_attention.py": "unit",
    "test_prefill_attention.py": "unit",
    "test_rmsnorm.py": "unit",
    "test_rope_kv.py": "unit",
    "test_sampling.py": "unit",
    "test_swiglu.py": "unit",
    # a real nats-server: stage adapters with fake neighbours, the launcher without the model
    "test_api_adapter.py": "adapter",
    "test_concurrent_handlers.py": "adapter",
    "test_compose_cluster.py": "adapter",
    "test_launcher.py": "adapter",
    "test_routing_units.py": "adapter",
    "test_scheduler_adapter.py": "adapter",
    "test_stage_adapters.py": "adapter",
    # the default model, or a whole stack serving it
    "test_api_errors.py": "e2e",
    "test_api_features.py": "e2e",
    "test_cluster_check.py": "e2e",
    "test_e2e.py": "e2e",
    "test_e2e_model_families.py": "e2e",
    "test_e2e_preemption.py": "e2e",
    "test_e2e_reasoning.py": "e2e",
    "test_e2e_speculation.py": "e2e",
    "test_e2e_structured_output.py": "e2e",
    "test_engine_moves.py": "e2e",
    "test_migration.py": "e2e",
    "test_executor_hf_parity.py": "e2e",
    "test_fast_mode_quality.py": "e2e",
    "test_faults.py": "e2e",
    "test_observability.py": "e2e",
    "test_overload_and_hostile_input.py": "e2e",
    "test_replicas.py": "e2e",
    "test_speculative_model.py": "e2e",
    "test_web_pages.py": "e2e",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unclassified = set()
    for item in items:
        if TESTS not in item.path.parents:
            continue
        kind = TEST_KINDS.get(item.path.name)
        if kind is None:
            unclassified.add(str(item.path.relative_to(TESTS.parent)))
            continue
        item.add_marker("e2e" if item.get_closest_marker("model") else kind)
    if unclassified:
        raise pytest.UsageError(
            f"test files without a kind: {', '.join(sorted(unclassified))}; add each to "
            "TEST_KINDS in tests/conftest.py as unit (no nats-server, no model), adapter (a "
            "real nats-server, no model) or e2e (the default model or a whole stack)")

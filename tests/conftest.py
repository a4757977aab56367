"""Shared fixtures: the session's real `llmbus up` stack (tests/stack.py starts it) and the
stacks that several modules share (a small KV cache; two copies of each stage), an OTLP
receiver for its traces, a nats-server per adapter test (`bus`), HF transformers as the greedy
reference. And every test's kind.

Kinds, one per test: `unit` (pure code: no nats-server, no model), `adapter` (a real
nats-server, no model) and `e2e` (the default model and/or a whole stack). Every test in
tests/e2e/, and every test marked `model`, is e2e; elsewhere a module says `adapter` (or `e2e`)
in its `pytestmark`, and is `unit` without one. `./dev test --fast` runs unit and adapter.
"""

from __future__ import annotations

from pathlib import Path

import nats
import pytest

from llmbus.services.launcher import Stack, _start_services, free_port, wait_until_ready
from llmbus.services.model_files import default_model_path
from tests.otlp_receiver import OtlpReceiver
from tests.stack import (
    API_KEY,
    TWO_OF_EACH_ARGV,
    ApiCopies,
    RunningStack,
    start_stack,
    stop_stack,
)
from tests.thinking_model import write_thinking_qwen3


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
    the fast default. Its lone streams take 8 steps a plan (--decode-plan-ms 200: the exact
    forwards take 13-25 ms), far more than the forwards in a streaming interval, so that
    test_a_lone_stream_gets_its_tokens_as_the_forwards_sample_them tells the two apart."""
    if not default_model_path().is_file():
        pytest.skip("default model not pulled (`llmbus model pull`)")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    running = start_stack(tmp_path_factory.mktemp("stack"), "--api-key", API_KEY, "--exact",
                          "--decode-plan-ms", "200", env=env)
    yield running
    stop_stack(running)


@pytest.fixture(scope="session")
def small_kv_stack(stack, tmp_path_factory: pytest.TempPathFactory) -> RunningStack:
    """A stack whose KV cache is too small for its load, so that requests are preempted
    (test_e2e_preemption, constrained requests in test_e2e_structured_output), with n-gram
    drafts on (test_e2e_speculation: preempted with drafts in flight or not): 40 blocks of 16
    tokens, about 10 short chats at once. Exact mode, as the shared stack (`stack`, started
    first) that its greedy outputs are compared with: drafts never change them."""
    running = start_stack(tmp_path_factory.mktemp("small-kv"), "--num-blocks", "41",
                          "--max-num-seqs", "32", "--num-speculative-tokens", "4", "--exact",
                          "--api-key", API_KEY)
    yield running
    stop_stack(running)


TRACE_URL = "http://127.0.0.1:16686/trace/{trace_id}"  # the api's links to a trace viewer


@pytest.fixture(scope="session")
def two_of_each() -> tuple[Stack, str, str]:
    """Two copies of every stage behind an API key, exact mode (test_replicas compares their
    outputs with the shared stack's), the engines serving LoRA adapters (test_lora), started
    one by one: not `llmbus up`, which stops everything when one dies. test_migration kills
    one process at a time and starts it again, test_replicas an engine's scheduler; test_web_pages,
    after them, kills a detokenizer copy last. Yields the stack, its api's root
    URL (`/v1` and the pages below it) and its nats URL."""
    if not default_model_path().is_file():
        pytest.skip("default model not pulled (`llmbus model pull`)")
    stack = Stack()
    port = free_port()
    url = stack.start_nats()
    argv = {"api": ["--port", str(port), "--api-key", API_KEY, "--trace-url", TRACE_URL],
            **TWO_OF_EACH_ARGV}
    copies = _start_services(stack, url, argv,
                             {"api": 2, "tokenizer": 2, "detokenizer": 2, "engine": 2})
    assert wait_until_ready(stack, f"http://127.0.0.1:{port}/health", 300, copies) is None
    yield stack, f"http://127.0.0.1:{port}", url
    stack.stop()


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


@pytest.fixture(scope="session")
def thinking_stack(tmp_path_factory: pytest.TempPathFactory) -> ApiCopies:
    """The generated thinking model (tests/thinking_model.py) behind two api copies with
    ports of their own: reasoning output, and what api copies share (stored responses)."""
    if not default_model_path().is_file():  # its vocabulary is the default model's
        pytest.skip("default model not pulled (`llmbus model pull`)")
    path = tmp_path_factory.mktemp("thinking") / "thinking-qwen3.gguf"
    write_thinking_qwen3(path)
    model = ["--model", str(path)]
    copies = ApiCopies.start({"tokenizer": model, "executor": [*model, "--threads", "1"],
                              "detokenizer": model, "api": []})
    yield copies
    copies.stop()


TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "adapter", "e2e")
# Fixtures that start real parts: a test using one is at least of that kind.
NEEDS = {"bus": "adapter", "stack": "e2e", "hf_reference": "e2e", "thinking_stack": "e2e",
         "small_kv_stack": "e2e", "two_of_each": "e2e"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test its kind: `e2e` in tests/e2e/ or when marked `model`; otherwise the
    module's own `pytestmark` (`adapter` or `e2e`), else `unit`. A test whose fixtures start
    more than its kind allows (a `unit` test asking for `bus`) stops the run, named."""
    wrong = []
    for item in items:
        if TESTS not in item.path.parents:
            continue
        declared = [m.name for m in item.iter_markers() if m.name in KINDS]
        if item.path.relative_to(TESTS).parts[0] == "e2e" or item.get_closest_marker("model"):
            kind = "e2e"
        else:
            kind = declared[0] if declared else "unit"
        needed = max((NEEDS[f] for f in item.fixturenames if f in NEEDS),
                     key=KINDS.index, default="unit")
        if KINDS.index(needed) > KINDS.index(kind):
            wrong.append(f"{item.nodeid} ({kind}, but its fixtures make it {needed})")
        if declared and declared[0] != kind:  # a `model` test in an adapter module, say
            wrong.append(f"{item.nodeid} (its module says {declared[0]}, but it is {kind})")
        if kind not in declared:
            item.add_marker(kind)
    if wrong:
        raise pytest.UsageError(
            "tests of the wrong kind: " + "; ".join(wrong) + ". A module's kind is its folder "
            "(tests/e2e/) or `pytestmark = pytest.mark.adapter` (a real nats-server, no model) "
            "/ `pytest.mark.e2e` (the default model or a whole stack); unit otherwise")

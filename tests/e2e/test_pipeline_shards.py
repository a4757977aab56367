"""Engines whose executors are split by layers into two processes each (`--pipeline-shards 2`,
services/executor/pipeline_lead_bus.py): greedy output as HF transformers computes it, a
prompt whose hidden states take several bus messages, each shard's span in its lead's step's
trace, and a layer shard killed mid-stream, whose stream finishes on the other engine with
the text it would have had."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from llmbus.services.launcher import Stack, _start_services, free_port, wait_until_ready
from tests.hf_reference import hf_greedy
from tests.stack import MODEL_NAME, engine_holding, needs_default_model, sse_events

pytestmark = [pytest.mark.model, needs_default_model()]
COPIES = {"api": 1, "tokenizer": 1, "detokenizer": 1, "engine": 2}
QUESTION = "Tell me a long story about a lighthouse."
MAX_TOKENS = 32
# ~600 tokens: 1.4 MB of hidden states (2,304 bytes a token) each way, in two messages or more
LONG_PROMPT = " ".join(f"Line {i}: the keeper climbs the stairs." for i in range(60))


@pytest.fixture(scope="module")
def split_engines(otlp):
    stack = Stack()
    stack.env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                      "OTEL_BSP_SCHEDULE_DELAY": "100"})
    port = free_port()
    url = stack.start_nats()
    argv = {"api": ["--port", str(port)], "executor": ["--threads", "1", "--exact"]}
    copies = _start_services(stack, url, argv, COPIES, pipeline_shards=2)
    assert copies["executor"] == 4  # two leads, two layer shards
    assert wait_until_ready(stack, f"http://127.0.0.1:{port}/health", 300, copies) is None
    yield stack, f"http://127.0.0.1:{port}/v1", url
    stack.stop()


async def _stream(http: httpx.AsyncClient, base_url: str, chunks: list[str]) -> dict:
    """One streamed greedy chat; each content chunk is appended to `chunks` as it comes."""
    body = {"model": MODEL_NAME, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": QUESTION}]}
    result: dict = {"error": None, "completion_tokens": None}
    async for event in sse_events(http, f"{base_url}/chat/completions", body):
        if "error" in event:
            result["error"] = event["error"]["message"]
        for choice in event.get("choices", []):
            chunks.append(choice["delta"].get("content") or "")
        if event.get("usage"):
            result["completion_tokens"] = event["usage"]["completion_tokens"]
    return result | {"text": "".join(chunks)}


def _shard_steps_under_lead_steps(otlp) -> int:
    """Layer shards' step spans whose parent is an executor step span (their lead's)."""
    spans = otlp.snapshot()
    steps = {s.span_id for s in spans if s.name == "executor.step"}
    return sum(s.name == "executor.shard_step" and s.parent_span_id in steps for s in spans)


async def test_split_engines_answer_as_transformers_and_outlive_a_shard(split_engines,
                                                                        hf_reference, otlp):
    stack, base_url, url = split_engines
    tokenizer, _ = hf_reference
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    expected = tokenizer.decode(hf_greedy(hf_reference, chat_ids, MAX_TOKENS),
                                skip_special_tokens=True)
    long_expected = tokenizer.decode(hf_greedy(hf_reference, tokenizer.encode(LONG_PROMPT), 4),
                                     skip_special_tokens=True)
    async with httpx.AsyncClient(timeout=120) as http:
        undisturbed = await _stream(http, base_url, [])
        assert undisturbed["error"] is None and undisturbed["text"] == expected
        long = (await http.post(f"{base_url}/completions", json={
            "model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 4,
            "temperature": 0})).json()
        assert long["choices"][0]["text"] == long_expected, long
        async with asyncio.timeout(30):  # a trace shows each shard's part of a step
            while not _shard_steps_under_lead_steps(otlp):
                await asyncio.sleep(0.2)

        chunks: list[str] = []
        stream = asyncio.create_task(_stream(http, base_url, chunks))
        async with asyncio.timeout(60):  # mid-stream: some text out, most still to come
            while len(chunks) < 8 and not stream.done():
                await asyncio.sleep(0.02)
        engine = await engine_holding(stack.observer_url(url))
        assert engine is not None and not stream.done(), "the stream ended before the kill"
        [shard] = [c for c in stack.children if c.name == f"executor.{engine[-1]}.shard1"]
        [lead] = [c for c in stack.children if c.name == f"executor.{engine[-1]}"]
        os.kill(shard.process.pid, signal.SIGKILL)
        moved = await asyncio.wait_for(stream, timeout=90)
    assert moved["error"] is None, moved
    assert (moved["text"], moved["completion_tokens"]) == (undisturbed["text"], MAX_TOKENS)
    assert lead.process.wait(timeout=30) == 1  # its shard gone, the lead gave its engine up
    assert any(f"shard 1/2 of engine {engine} went silent during a step; exiting" in line
               for line in lead.tail), lead.tail

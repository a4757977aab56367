"""Request migration (services/api/migration.py): an engine dies mid-stream, and its streams
move to the other engine, resumed from the tokens already streamed. Each client sees one
stream with the text of an undisturbed run: greedy and seeded alike, no token twice, none
missing. Exact mode on both engines, so that computing the streamed tokens again as a prompt
gives the logits decoding them one by one gave (as the preemption test relies on)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import EngineStats, EngineStatsRequest
from llmbus.services.launcher import Stack, _start_services, free_port, wait_until_ready
from llmbus.services.scheduler.detokenizer_routing import preferred_copy
from tests.stack import MODEL_NAME, needs_default_model

pytestmark = [pytest.mark.model, needs_default_model()]
ENGINES = {"api": 1, "tokenizer": 1, "detokenizer": 2, "engine": 2}
MAX_TOKENS = 64
# Greedy, seeded sampling (its draws depend on the seed and the position alone), and a
# constrained request (the new engine's matcher replays the tokens already streamed).
REQUESTS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "seed": 11, "frequency_penalty": 0.5},
    "grammar": {"temperature": 0, "guided_regex": "Once upon a time, ([a-z]+[,.]? ){1,100}"},
}
# Each victim once, each kind once or more (the suite's time is counted: the cluster check
# and bench/cluster_check.sh cover every fault, greedy).
CASES = [("greedy", "scheduler"), ("seeded", "executor"), ("seeded", "detokenizer"),
         ("grammar", "scheduler")]


@pytest.fixture(scope="module")
def two_engines():
    stack = Stack()
    port = free_port()
    url = stack.start_nats()
    argv = {"api": ["--port", str(port)], "executor": ["--threads", "1", "--exact"]}
    copies = _start_services(stack, url, argv, ENGINES)
    health = f"http://127.0.0.1:{port}/health"
    assert wait_until_ready(stack, health, 300, copies) is None
    yield stack, f"http://127.0.0.1:{port}/v1", url, argv, health
    stack.stop()


async def _stream(http: httpx.AsyncClient, base_url: str, sampling: dict,
                  chunks: list[str] | None = None, ids: list[str] | None = None) -> dict:
    """One streamed chat: its text, finish reason, token count and any error event; each
    content chunk is appended to `chunks` as it comes, and its id to `ids`."""
    body = {"model": MODEL_NAME, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            **sampling}
    chunks = [] if chunks is None else chunks
    result = {"finish_reason": None, "completion_tokens": None, "error": None}
    async with http.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                result["error"] = event["error"]["message"]
                continue
            if ids is not None and not ids:
                ids.append(event["id"])
            for choice in event["choices"]:
                if choice["delta"].get("content"):
                    chunks.append(choice["delta"]["content"])
                result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
            if event.get("usage"):
                result["completion_tokens"] = event["usage"]["completion_tokens"]
    return result | {"text": "".join(chunks)}


async def _engine_holding(nats_url: str) -> str | None:
    """The engine running requests now (None: neither)."""
    nc = await nats.connect(nats_url)
    try:
        for engine_id in ("engine0", "engine1"):
            msg = await nc.request(subjects.engine_stats(engine_id),
                                   encode(EngineStatsRequest()), timeout=5)
            if decode(msg.data, EngineStats).num_running:
                return engine_id
        return None
    finally:
        await nc.close()


async def _migrations(http: httpx.AsyncClient, base_url: str) -> float:
    """The api's count of migrations (/metrics)."""
    text = (await http.get(base_url.removesuffix("/v1") + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmbus:request_migrations_total"))


def _replica(child) -> str:
    """A service process's instance id, from its log lines."""
    return next(line.split("replica=")[1].split()[0] for line in child.tail
                if "replica=" in line)


@pytest.mark.parametrize(("kind", "victim"), CASES)
async def test_a_stream_whose_engine_dies_resumes_on_the_other_engine(two_engines, victim,
                                                                      kind):
    """The detokenizer's case: the engine moves the stream to the other copy, which never
    got the tokens the dead copy lost; the api sees the gap and resumes the request from what
    its client has."""
    stack, base_url, url, argv, health = two_engines
    observer = stack.observer_url(url)
    async with httpx.AsyncClient(timeout=120) as http:
        undisturbed = await _stream(http, base_url, REQUESTS[kind])
        chunks: list[str] = []
        stream_ids: list[str] = []
        stream = asyncio.create_task(_stream(http, base_url, REQUESTS[kind], chunks,
                                             stream_ids))
        async with asyncio.timeout(60):  # mid-stream: some text out, most still to come
            while len(chunks) < 8 and not stream.done():
                await asyncio.sleep(0.02)
        if victim == "detokenizer":  # the copy the engine sends this stream to
            copies = {_replica(c): c for c in stack.children if c.name.startswith(victim)}
            child = copies[preferred_copy((stream_ids[0], 0), set(copies))]
            victim_argv = ["--nats-url", url]
        else:
            engine = await _engine_holding(observer)
            assert engine is not None, "the stream ended before the kill"
            [child] = [c for c in stack.children if c.name == f"{victim}.{engine[-1]}"]
            victim_argv = ["--nats-url", url, "--engine-id", engine, *argv.get(victim, [])]
        assert not stream.done(), "the stream ended before the kill"
        migrations = await _migrations(http, base_url)
        os.kill(child.process.pid, signal.SIGKILL)
        moved = await asyncio.wait_for(stream, timeout=60)
        assert await _migrations(http, base_url) > migrations
    assert undisturbed["error"] is None and undisturbed["completion_tokens"] == MAX_TOKENS
    assert moved["error"] is None, moved
    assert moved["text"] == undisturbed["text"]  # nothing repeated, nothing lost
    assert (moved["finish_reason"], moved["completion_tokens"]) == ("length", MAX_TOKENS)
    # Back to two copies for the next test.
    stack.children.remove(child)
    stack.start_service(victim, victim_argv, child.name)
    assert wait_until_ready(stack, health, 300, {victim: 2}) is None

"""An engine dies holding requests that have sent nothing yet: they move to the other engine
and end with their full answers, not errors (services/api/migration_bus.py's watchdog)."""

from __future__ import annotations

import asyncio
import signal

import httpx
import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import EngineStats, EngineStatsRequest
from llmbus.services.launcher import Stack, _start_services, free_port, wait_until_ready
from tests.stack import MODEL_NAME, needs_default_model

pytestmark = [pytest.mark.model, needs_default_model()]


@pytest.fixture(scope="module")
def two_engines():
    stack = Stack()
    port = free_port()
    url = stack.start_nats()
    argv = {"api": ["--port", str(port)], "executor": ["--threads", "1"]}
    copies = _start_services(stack, url, argv,
                             {"api": 1, "tokenizer": 1, "detokenizer": 1, "engine": 2})
    assert wait_until_ready(stack, f"http://127.0.0.1:{port}/health", 300, copies) is None
    yield stack, f"http://127.0.0.1:{port}/v1", stack.observer_url(url)
    stack.stop()


async def _held_by(nats_url: str, engine_id: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request(subjects.engine_stats(engine_id), encode(EngineStatsRequest()),
                               timeout=5)
        stats = decode(msg.data, EngineStats)
        return stats.num_running + stats.num_waiting
    finally:
        await nc.close()


async def test_requests_of_a_dead_engine_that_sent_nothing_move_and_finish(two_engines):
    stack, base_url, nats_url = two_engines
    # Long prompts (~600 tokens): one thread prefills each in several chunks, a good part of a
    # second, and the kill comes as soon as engine1 holds one, so it has sent nothing.
    prompts = [f"Text {i}: " + " ".join(f"w{i}x{j}" for j in range(150)) + " Summarize."
               for i in range(4)]

    async def complete(http: httpx.AsyncClient, prompt: str) -> dict:
        response = await http.post(f"{base_url}/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        return {"status": response.status_code, "body": response.json()}

    async with httpx.AsyncClient(timeout=300) as http:
        run = asyncio.gather(*(complete(http, p) for p in prompts))
        for _ in range(100):  # until engine1 holds some of them (admitted, prefilling)
            if await _held_by(nats_url, "engine1") > 0:
                break
            await asyncio.sleep(0.05)
        held = await _held_by(nats_url, "engine1")
        assert held > 0
        [scheduler] = [c for c in stack.children if c.name == "scheduler.1"]
        scheduler.process.send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(run, timeout=280)
    # Every request ends with its answer: engine1's moved to engine0, which served them all.
    assert all(r["status"] == 200 for r in results), results
    assert all(r["body"]["choices"][0]["finish_reason"] == "length" for r in results), results
    assert all(r["body"]["usage"]["completion_tokens"] == 4 for r in results), results

"""Kill -9 each kind of service mid-stream: every client ends within seconds (the silence
that makes a copy dead, a resumption's patience, and slack for a busy machine), and once the
service is restarted the stack serves again; the bus killed and started again loses no
stream. (SIGTERM during a stream, which ends it cleanly: test_launched_stack.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from llmbus.bus.liveness import DEAD_AFTER
from llmbus.services.api.migration_bus import RESUME_PATIENCE
from llmbus.services.launcher import Stack, _start_services, free_port, wait_until_ready
from tests.stack import AUTH, MODEL_NAME, needs_default_model

pytestmark = [pytest.mark.model, needs_default_model()]
ONE_OF_EACH = {"api": 1, "tokenizer": 1, "detokenizer": 1, "engine": 1}
# A dead copy's requests end within: its silence judged, one try to resume them elsewhere
# (the one engine's executor dead: none takes them), and 4 s for a busy machine.
ENDED_WITHIN = DEAD_AFTER + RESUME_PATIENCE + 4


@pytest.fixture(scope="module")
def services(stack):
    """One copy of each service, started one by one so that one may die alone."""
    stack_ = Stack()
    port = free_port()
    url = stack_.start_nats()
    argv = {"api": ["--port", str(port)]}
    copies = _start_services(stack_, url, argv, ONE_OF_EACH)
    health = f"http://127.0.0.1:{port}/health"
    assert wait_until_ready(stack_, health, 300, copies) is None
    yield stack_, f"http://127.0.0.1:{port}/v1", url, argv, health
    stack_.stop()


async def _streaming(base_url: str, count: int, max_tokens: int = 300) -> list[asyncio.Task]:
    """`count` streams, once each has had some text (a stream of `_stream`'s endings)."""
    started = [asyncio.Event() for _ in range(count)]
    streams = [asyncio.create_task(_stream(base_url, max_tokens, event)) for event in started]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=60)
    return streams


async def _stream(base_url: str, max_tokens: int = 300,
                  streaming: asyncio.Event | None = None) -> str:
    """How a stream ended: "done", "error event" (the server said why, in the stream),
    "refused <status>" (no stream at all), or "cut" (the connection ended with neither done
    nor error); never hangs past the test. `streaming` is set once text has arrived."""
    body = {"model": MODEL_NAME, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    try:
        async with httpx.AsyncClient(timeout=60) as http, http.stream(
                "POST", f"{base_url}/chat/completions", json=body) as response:
            if response.status_code != 200:
                return f"refused {response.status_code}"
            async for line in response.aiter_lines():
                if streaming is not None and '"content":"' in line:
                    streaming.set()
                if line.startswith('data: {"error"'):
                    return "error event"
                if line == "data: [DONE]":
                    return "done"
        return "cut"
    except httpx.HTTPError:
        return "cut"


@pytest.mark.parametrize("victim", ["executor", "scheduler", "detokenizer", "tokenizer", "api"])
async def test_kill_9_mid_stream_then_restart(services, victim):
    stack, base_url, url, argv, health = services
    # The tokenizer's streams must run to their end, so theirs are shorter; every other
    # victim's end mid-answer, as long as they run past the kill (they cannot end sooner).
    streams = await _streaming(base_url, 3, max_tokens=100 if victim == "tokenizer" else 300)
    [child] = [c for c in stack.children if c.name == victim]
    os.kill(child.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    if victim == "tokenizer":
        # Admitted before the kill, the streams go on; a new request is refused at once.
        started = time.monotonic()
        assert await _stream(base_url, max_tokens=4) in ("error event", "refused 503")
        assert time.monotonic() - started < 10
        assert await asyncio.wait_for(asyncio.gather(*streams), timeout=120) == ["done"] * 3
    else:
        results = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
        assert time.monotonic() - killed_at < ENDED_WITHIN
        # The api's own death cuts its connections; any other stage's, the api reports in
        # each stream (nothing else serves these requests: one copy of each stage).
        assert results == ["cut" if victim == "api" else "error event"] * 3, results
    stack.children.remove(child)
    stack.start_service(victim, ["--nats-url", url, *argv.get(victim, [])])
    assert wait_until_ready(stack, health, 120, {"api": 1}) is None
    assert await _stream(base_url, max_tokens=4) == "done"


async def test_the_bus_killed_and_back_3_s_later_loses_no_stream(services):
    """One nats-server, kill -9 mid-stream, started again 3 s later: every stage reconnects
    to it as the same copy, each recovers what the gap may have lost (the api resumes its
    requests from what their clients have), and every stream ends with its whole answer."""
    stack, base_url, url, argv, health = services
    streams = await _streaming(base_url, 3, max_tokens=100)
    [child] = [c for c in stack.children if c.name == "nats"]
    os.kill(child.process.pid, signal.SIGKILL)
    child.process.wait()
    await asyncio.sleep(3.0)
    stack.children.remove(child)
    stack._spawn("nats", child.process.args)  # the same port, users and permissions
    assert await asyncio.wait_for(asyncio.gather(*streams), timeout=120) == ["done"] * 3


def test_soak_runs_briefly_on_the_shared_stack(stack):
    """The soak script's load and report (a short run here, on the shared stack; minutes long
    outside CI, on a stack of its own): nothing leaked, no error."""
    from llmbus.bench.soak import soak

    report, leaked, errors = soak(stack, seconds=4, concurrency=4, headers=AUTH)
    print(report)
    assert (leaked, errors) == (0, 0), report
    assert "requests: 0 ok" not in report

"""Two copies of every stage on one machine: all requests served correctly, work spread over
every copy, and losing an engine mid-run ends no request in a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import nats
import openai
import pytest

from bus import subjects
from bus.messages import Heartbeat
from services.launcher import Stack, _start_services, free_port, wait_until_ready
from tests.conftest import API_KEY, MODEL_NAME, needs_default_model
from tests.test_launcher import processes_mentioning

pytestmark = [pytest.mark.model, needs_default_model()]

REPLICAS = {"api": 2, "tokenizer": 2, "detokenizer": 2, "engine": 2}


@pytest.fixture(scope="module")
def replicas():
    """Services started one by one (not `llmbus up`, which stops everything when one dies)."""
    stack = Stack()
    port = free_port()
    url = stack.start_nats()
    argv = {"api": ["--port", str(port)], "scheduler": ["--max-num-seqs", "32"],
            "executor": ["--threads", "1"]}
    copies = _start_services(stack, url, argv, REPLICAS)
    assert wait_until_ready(stack, f"http://127.0.0.1:{port}/health", 300, copies) is None
    yield stack, f"http://127.0.0.1:{port}/v1", stack.observer_url(url)
    stack.stop()


async def _work_by_copy(nats_url: str) -> dict[tuple[str, str], int]:
    nc = await nats.connect(nats_url)
    seen: dict[tuple[str, str], int] = {}

    async def on_beat(msg) -> None:
        beat = msgspec.msgpack.decode(msg.data, type=Heartbeat)
        seen[(beat.service, beat.instance_id)] = beat.num_handled

    await nc.subscribe(f"{subjects.PREFIX}.heartbeat.*", cb=on_beat)
    await asyncio.sleep(1.5)
    await nc.close()
    return seen


async def _ask_all(base_url: str, questions: list[str], max_tokens: int = 16):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)

    async def ask(question: str) -> str | Exception:
        parts = []
        try:
            async for chunk in await client.chat.completions.create(
                    model=MODEL_NAME, temperature=0, max_tokens=max_tokens, stream=True,
                    messages=[{"role": "user", "content": question}]):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
            return "".join(parts)
        except Exception as exc:  # an explicit error is an acceptable end; a hang is not
            return exc

    return await asyncio.gather(*(ask(q) for q in questions))


async def test_every_copy_serves_and_outputs_are_exact(replicas, stack):
    _, base_url, nats_url = replicas
    questions = [f"Give me a word that rhymes with number {i}." for i in range(64)]
    expected = await _ask_all(stack.base_url, questions)  # the one-copy stack
    got = await _ask_all(base_url, questions)
    assert got == expected
    work = await _work_by_copy(nats_url)
    for service in ("api", "tokenizer", "detokenizer", "scheduler", "executor"):
        counts = [n for (s, _), n in work.items() if s == service]
        assert len(counts) == 2 and all(n > 0 for n in counts), (service, counts)


async def test_losing_an_engine_ends_every_request_and_the_other_serves_on(replicas):
    stack, base_url, _ = replicas
    questions = [f"Write a long story about a dragon named {i}." for i in range(16)]
    run = asyncio.create_task(_ask_all(base_url, questions, max_tokens=200))
    await asyncio.sleep(3)  # requests spread over both engines and streaming
    [pid] = [p for p in processes_mentioning("serve scheduler")
             if p in {c.process.pid for c in stack.children}
             and "engine1" in open(f"/proc/{p}/cmdline").read()]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(run, timeout=120)
    assert time.monotonic() - killed_at < 100  # the survivors finish their 200 tokens
    failed = [r for r in results if isinstance(r, Exception)]
    assert 0 < len(failed) < len(results)  # engine1's streams failed, engine0's finished
    # New requests go to the live engine.
    again = await _ask_all(base_url, ["Say hi."] * 4, max_tokens=4)
    assert all(isinstance(r, str) and r for r in again)

"""Two copies of every stage on one machine: all requests served correctly, work spread over
every copy, and losing an engine mid-run ends no request in a hang."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import msgspec
import nats
import openai
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import EngineStats, EngineStatsRequest, Heartbeat
from llmbus.services.launcher import wait_until_ready
from tests.stack import API_KEY, AUTH, MODEL_NAME, needs_default_model

pytestmark = [pytest.mark.model, needs_default_model()]



@pytest.fixture(scope="module")
def replicas(two_of_each):
    """conftest's two copies of every stage (test_web_pages uses them after these tests)."""
    stack, root, url = two_of_each
    yield stack, f"{root}/v1", stack.observer_url(url)


SERVICES = ("api", "tokenizer", "detokenizer", "scheduler", "executor")


async def _work_by_copy(nats_url: str) -> dict[tuple[str, str], int]:
    """Each copy's work done so far, from its heartbeats: listened to until two copies of
    every service have beaten (or 30 s, after which the caller's checks say who is missing)."""
    nc = await nats.connect(nats_url)
    seen: dict[tuple[str, str], int] = {}

    async def on_beat(msg) -> None:
        beat = msgspec.msgpack.decode(msg.data, type=Heartbeat)
        seen[(beat.service, beat.instance_id)] = beat.num_handled

    await nc.subscribe(f"{subjects.PREFIX}.heartbeat.*", cb=on_beat)
    deadline = asyncio.get_running_loop().time() + 30
    while (any(sum(s == service for s, _ in seen) < 2 for service in SERVICES)
           and asyncio.get_running_loop().time() < deadline):
        await asyncio.sleep(0.1)
    await nc.close()
    return seen


async def _ask_all(base_url: str, questions: list[str], max_tokens: int = 16,
                   timeout: float = 60):
    async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                  timeout=timeout) as client:  # closed: see test_e2e_preemption

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
    # 32 at once: as many connections, which the kernel spreads over both api copies
    questions = [f"Give me a word that rhymes with number {i}." for i in range(32)]
    expected = await _ask_all(stack.base_url, questions)  # the one-copy stack
    got = await _ask_all(base_url, questions)
    assert got == expected
    work = await _work_by_copy(nats_url)
    for service in SERVICES:
        counts = [n for (s, _), n in work.items() if s == service]
        assert len(counts) == 2 and all(n > 0 for n in counts), (service, counts)


def _finished_by_copy(metrics_text: str) -> dict[str, float]:
    """`llmbus:request_success_total` summed per api copy (its `replica` label)."""
    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("llmbus:request_success_total{"):
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            counts[replica] = counts.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


async def test_any_scrape_counts_the_requests_of_every_api_copy(replicas):
    """The api copies share one port, so a scrape lands on either: each must show both
    copies' request counters, adding up to every request served."""
    _, base_url, _ = replicas
    root = base_url.removesuffix("/v1")

    async def scrape() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=30) as http:  # a new connection each time
            response = await http.get(f"{root}/metrics")
        assert response.status_code == 200
        return _finished_by_copy(response.text)

    before = sum((await scrape()).values())
    for i in range(16):  # fresh connections, which the kernel spreads over the copies
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
            response = await http.post(f"{base_url}/completions", json={
                "model": MODEL_NAME, "prompt": f"Count {i}:", "max_tokens": 2})
        assert response.status_code == 200, response.text
    for _ in range(6):
        counts = await scrape()
        assert len(counts) == 2, counts
        assert sum(counts.values()) == before + 16, counts


async def _engine_running(nats_url: str, engine_id: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request(subjects.engine_stats(engine_id), encode(EngineStatsRequest()),
                               timeout=5)
        return decode(msg.data, EngineStats).num_running
    finally:
        await nc.close()


async def test_losing_an_engine_ends_every_request_and_the_other_serves_on(replicas):
    stack, base_url, nats_url = replicas
    # Distinct prompts: little shared prefix, so routing spreads them by load (4 each here;
    # a single-threaded exact engine prefills one in a fraction of a second).
    questions = [f"Story {i}: " + " ".join(f"w{i}x{j}" for j in range(60))
                 + " Continue this story." for i in range(8)]
    # The client timeout is generous: on a slow or busy machine the surviving engine may take
    # minutes for its share, and a client that gave up would hide whether it was served.
    run = asyncio.create_task(_ask_all(base_url, questions, max_tokens=48, timeout=200))
    for _ in range(100):  # until engine1 is decoding some of them
        if await _engine_running(nats_url, "engine1") > 0:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    assert await _engine_running(nats_url, "engine1") > 0
    [scheduler] = [c for c in stack.children if c.name == "scheduler.1"]
    assert "engine1" in open(f"/proc/{scheduler.process.pid}/cmdline").read()
    os.kill(scheduler.process.pid, signal.SIGKILL)
    # Every client ends: engine1's streams with an error (or, if nothing was sent yet,
    # moved to engine0), engine0's with their full text. None hangs.
    results = await asyncio.wait_for(run, timeout=240)
    # Each ends with its text, or with an error event the api sent (the SDK raises it as an
    # APIError): not a timeout, not a dropped connection, not an empty answer.
    assert all((isinstance(r, str) and r) or type(r) is openai.APIError for r in results), \
        results
    assert any(isinstance(r, str) and r for r in results)
    # New requests go to the live engine.
    again = await _ask_all(base_url, ["Say hi."] * 4, max_tokens=4)
    assert all(isinstance(r, str) and r for r in again)
    # Two engines again, for test_web_pages.
    stack.children.remove(scheduler)
    argv = scheduler.process.args  # [python, -m, llmbus.services.cli, serve, scheduler, ...]
    stack.start_service("scheduler", argv[argv.index("scheduler") + 1:], scheduler.name)
    health = base_url.removesuffix("/v1") + "/health"
    assert wait_until_ready(stack, health, 300, {"scheduler": 2}) is None

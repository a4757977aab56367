"""Disaggregated serving end to end: one prefill engine and one decode engine (`--role`, with
`--disaggregation always`), exact mode. The prefill engine computes each prompt's KV into the
decode engine's blocks over the bus and samples the first token; the decode engine streams the
rest. Its answers are a mixed engine's (the decode engine prefilling itself, once the prefill
engine is gone, is exactly one); a prefill engine killed mid-transfer costs the client nothing;
a decode engine killed mid-transfer leaves the prefill engine holding no block.

The tests run in order on one stack (each leaves it as the next expects). The prefill engine
caches no prefix, so that each of its prefills takes long enough to be killed in, and a prompt
it served once is computed afresh elsewhere."""

from __future__ import annotations

import asyncio
import os
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
STAGES = {"api": 1, "tokenizer": 1, "detokenizer": 1, "engine": 0}
EXECUTOR = ["--threads", "1", "--exact"]
ROLES = {"prefill": ["--role", "prefill", "--no-prefix-caching"],
         # Only the heartbeats may tell it of a dead prefill engine (not a time-out).
         "decode": ["--role", "decode", "--disaggregation", "always",
                    "--remote-prefill-timeout", "600"]}
WORDS = ("the lighthouse keeper counted ships in the fog while gulls argued over the pier and "
         "the old radio hummed songs about harbours rivers and distant cities ").split()
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # K and V of one block of the default model, float32
MAX_TOKENS = 8


def text(num_words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(i + offset) % len(WORDS)] for i in range(num_words))


# Short, medium, long; the last shares the medium one's beginning (a prefix cached on the
# decode engine, so only the rest is asked of the prefill engine).
PROMPTS = [text(40), text(400, 3), text(900, 7), text(400, 3) + " and then " + text(60, 11)]
# Long enough to be killed mid-transfer: one while the decode engine dies, one while the
# prefill engine does (served once before, on the decode engine that is killed).
LONG_A, LONG_B = text(2000, 5), text(1000, 9)


@pytest.fixture(scope="module")
def disaggregated():
    stack = Stack()
    port = free_port()
    url = stack.start_nats()
    copies = _start_services(stack, url, {"api": ["--port", str(port)]}, STAGES)
    for role in ROLES:
        start_engine(stack, url, role)
    health = f"http://127.0.0.1:{port}/health"
    assert wait_until_ready(stack, health, 300, copies | {"scheduler": 2}) is None
    asyncio.run(heard_of_the_prefill_engine(stack.observer_url(url)))
    state: dict = {}
    yield stack, f"http://127.0.0.1:{port}/v1", stack.observer_url(url), url, health, state
    stack.stop()


def start_engine(stack: Stack, url: str, role: str) -> None:
    engine = ["--nats-url", url, "--engine-id", f"{role}0"]
    stack.start_service("executor", [*engine, *EXECUTOR], f"executor.{role}")
    stack.start_service("scheduler", [*engine, *ROLES[role]], f"scheduler.{role}")


async def heard_of_the_prefill_engine(observer: str) -> None:
    """Ready is not enough: the decode engine learns of prefill engines by their heartbeats."""
    async with asyncio.timeout(30):
        while not (await stats(observer, "decode0")).num_prefill_engines:
            await asyncio.sleep(0.1)


async def complete(http: httpx.AsyncClient, base_url: str, prompt: str) -> dict:
    response = await http.post(f"{base_url}/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    return {"status": response.status_code, **response.json()}


async def stats(observer: str, engine_id: str) -> EngineStats:
    nc = await nats.connect(observer)
    try:
        return await stats_of(nc, engine_id)
    finally:
        await nc.close()


async def stats_of(nc: nats.NATS, engine_id: str) -> EngineStats:
    msg = await nc.request(subjects.engine_stats(engine_id), encode(EngineStatsRequest()),
                           timeout=5)
    return decode(msg.data, EngineStats)


async def kill_engine_mid_prefill(stack: Stack, observer: str, role: str,
                                  request: asyncio.Task) -> list:
    """SIGKILL one engine's scheduler and executor once the prefill engine has computed two
    chunks of the prompt (their blocks are on their way or there); returns the children."""
    nc = await nats.connect(observer)
    try:
        before = (await stats_of(nc, "prefill0")).num_steps
        async with asyncio.timeout(60):
            while (await stats_of(nc, "prefill0")).num_steps < before + 2:
                assert not request.done(), "the prefill ended before the kill"
                await asyncio.sleep(0.02)
    finally:
        await nc.close()
    children = [c for c in stack.children if c.name.endswith(f".{role}")]
    assert len(children) == 2
    for child in children:
        os.kill(child.process.pid, signal.SIGKILL)
    return children


async def test_prompts_prefilled_remotely_decode_here(disaggregated):
    stack, base_url, observer, _, _, state = disaggregated
    async with httpx.AsyncClient(timeout=180) as http:
        answers = [await complete(http, base_url, p) for p in [*PROMPTS, LONG_B]]
        metrics = (await http.get(base_url.removesuffix("/v1") + "/metrics")).text
    assert all(a["status"] == 200 for a in answers), answers
    state["remote"] = [a["choices"][0]["text"] for a in answers]
    d, p = await stats(observer, "decode0"), await stats(observer, "prefill0")
    assert (d.num_remote_prefills, d.num_remote_fallbacks) == (len(answers), 0)
    assert p.num_prefilled_for_others == len(answers) == p.num_finished
    # Every block after the prefix cached here moved once, and only those: the last prompt's
    # shared beginning stayed.
    prompt_tokens = [a["usage"]["prompt_tokens"] for a in answers]
    assert d.num_prefix_hit_tokens > 0
    blocks = sum(-(-n // 16) for n in prompt_tokens) - d.num_prefix_hit_tokens // 16
    assert d.kv_bytes_received == blocks * BLOCK_BYTES
    samples = {(line.split("{")[0], line.split('replica="')[1].split('"')[0]):
               float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line.startswith("llmbus:") and "replica" in line}
    assert samples["llmbus:remote_prefills_total", "decode0"] == len(answers)
    assert samples["llmbus:kv_transfer_bytes_total", "decode0"] == d.kv_bytes_received
    assert samples["llmbus:prefilled_for_others_total", "prefill0"] == len(answers)
    assert p.num_running == p.num_waiting == 0 and p.num_free_blocks == p.num_total_blocks


async def test_a_decode_engine_killed_mid_transfer_leaves_no_block_held(disaggregated):
    stack, base_url, observer, url, health, _ = disaggregated
    before = await stats(observer, "prefill0")
    async with httpx.AsyncClient(timeout=180) as http:
        request = asyncio.create_task(complete(http, base_url, LONG_A))
        children = await kill_engine_mid_prefill(stack, observer, "decode", request)
        answer = await asyncio.wait_for(request, timeout=60)
    assert answer["status"] >= 500 or "error" in answer  # no engine left to take it
    async with asyncio.timeout(30):  # its transfer fails: the prefill engine drops it
        while True:
            p = await stats(observer, "prefill0")
            if p.num_running == p.num_waiting == 0:
                break
            await asyncio.sleep(0.1)
    assert p.num_free_blocks == p.num_total_blocks
    assert p.num_prefilled_for_others == before.num_prefilled_for_others
    # ... and stopped early: the prompt (2,000 words, a token or more each) needs more than
    # 2000 // 256 steps of the whole token budget to be prefilled to its end.
    assert p.num_steps - before.num_steps < 2000 // 256
    for child in children:  # the decode engine again, afresh, for the next tests
        stack.children.remove(child)
    start_engine(stack, url, "decode")
    assert wait_until_ready(stack, health, 300, {"scheduler": 2, "executor": 2}) is None
    await heard_of_the_prefill_engine(observer)


async def test_a_prefill_engine_killed_mid_transfer_costs_the_client_nothing(disaggregated):
    """The decode engine notices by the heartbeats and prefills the prompt itself: the answer
    the prefill engine gave it before (test 1), when all was well."""
    stack, base_url, observer, _, _, state = disaggregated
    async with httpx.AsyncClient(timeout=180) as http:
        request = asyncio.create_task(complete(http, base_url, LONG_B))
        await kill_engine_mid_prefill(stack, observer, "prefill", request)
        answer = await asyncio.wait_for(request, timeout=120)
    assert answer["status"] == 200, answer
    assert answer["choices"][0]["text"] == state["remote"][-1]
    d = await stats(observer, "decode0")
    assert (d.num_remote_prefills, d.num_remote_fallbacks) == (1, 1)
    state["no_prefill_engine"] = True


async def test_the_answers_are_a_mixed_engines(disaggregated):
    """With the prefill engine gone, the decode engine prefills itself, as a mixed one does;
    it started afresh after the kill above, so nothing of those prompts is cached."""
    _, base_url, observer, _, _, state = disaggregated
    assert state.get("no_prefill_engine") and "remote" in state
    async with httpx.AsyncClient(timeout=180) as http:
        answers = [await complete(http, base_url, p) for p in PROMPTS]
    assert [a["choices"][0]["text"] for a in answers] == state["remote"][:len(PROMPTS)]
    assert (await stats(observer, "decode0")).num_remote_prefills == 1  # the killed one only

"""Request migration (services/api/migration.py): an engine dies mid-stream, and its streams
move to the other engine, resumed from the tokens already streamed. Each client sees one
stream with the text of an undisturbed run: greedy and seeded alike, no token twice, none
missing. Exact mode on both engines, so that computing the streamed tokens again as a prompt
gives the logits decoding them one by one gave (as the preemption test relies on). And an
engine that dies holding requests that have sent nothing yet: they move too, and end with
their full answers, not errors (services/api/migration_bus.py's watchdog).

The tests run on conftest's two_of_each stack (two copies of every stage, exact mode, behind an
API key); each starts again what the one before killed, and the module what its last one did
(test_replicas and test_web_pages use the stack next)."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field

import httpx
import pytest

from llmbus.services.launcher import Stack, wait_until_ready
from llmbus.services.scheduler.detokenizer_routing import preferred_copy
from tests.stack import (
    AUTH,
    MODEL_NAME,
    TWO_OF_EACH_ARGV,
    engine_holding,
    engine_stats,
    needs_default_model,
    sse_events,
)

pytestmark = [pytest.mark.model, needs_default_model()]
MAX_TOKENS = 64
# Greedy, seeded sampling (its draws depend on the seed and the position alone), and a
# constrained request (the new engine's matcher replays the tokens already streamed).
REQUESTS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "seed": 11, "frequency_penalty": 0.5},
    "grammar": {"temperature": 0, "guided_regex": "Once upon a time, ([a-z]+[,.]? ){1,100}"},
}
# Each victim once, each kind once (the suite's time is counted: the cluster check, the
# chaos soak and bench/cluster_check.sh cover every fault). The executor last: it is the
# slowest to start again.
CASES = [("greedy", "scheduler"), ("seeded", "detokenizer"), ("grammar", "executor")]


@dataclass
class TwoEngines:
    stack: Stack
    base_url: str
    url: str
    argv: dict[str, list[str]]
    health: str
    killed: list[tuple[str, list[str], str]] = field(default_factory=list)  # to start again
    undisturbed: dict[str, dict] = field(default_factory=dict)  # by kind of request

    def kill(self, child, stage: str, argv: list[str]) -> None:
        os.kill(child.process.pid, signal.SIGKILL)
        self.stack.children.remove(child)
        self.killed.append((stage, argv, child.name))

    def restore(self) -> None:
        """Start again what a test before killed: two copies of each stage."""
        for stage, argv, name in self.killed:
            self.stack.start_service(stage, argv, name)
        if self.killed:
            dead = wait_until_ready(self.stack, self.health, 300,
                                    {stage: 2 for stage, _, _ in self.killed})
            assert dead is None, f"{dead.name} died: {list(dead.tail)}"
        self.killed.clear()


@pytest.fixture(scope="module")
def two_engines(two_of_each):
    stack, root, url = two_of_each
    engines = TwoEngines(stack, f"{root}/v1", url, TWO_OF_EACH_ARGV, f"{root}/health")
    yield engines
    engines.restore()


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
    async for event in sse_events(http, f"{base_url}/chat/completions", body):
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


async def _migrations(http: httpx.AsyncClient, base_url: str) -> float:
    """The api's count of migrations (/metrics)."""
    text = (await http.get(base_url.removesuffix("/v1") + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmbus:request_migrations_total"))


def _replica(child) -> str:
    """A service process's instance id, from its log lines."""
    return next(line.split("replica=")[1].split()[0] for line in child.tail
                if "replica=" in line)


async def test_requests_of_a_dead_engine_that_sent_nothing_move_and_finish(two_engines):
    two_engines.restore()
    observer = two_engines.stack.observer_url(two_engines.url)
    # Long prompts (~600 tokens): one thread prefills each in several chunks, a good part of a
    # second, and the kill comes as soon as engine1 holds one, so it has sent nothing.
    prompts = [f"Text {i}: " + " ".join(f"w{i}x{j}" for j in range(150)) + " Summarize."
               for i in range(4)]

    async def complete(http: httpx.AsyncClient, prompt: str) -> dict:
        response = await http.post(f"{two_engines.base_url}/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        return {"status": response.status_code, "body": response.json()}

    async def held_by_engine1() -> int:
        stats = await engine_stats(observer, "engine1")
        return stats.num_running + stats.num_waiting

    async with httpx.AsyncClient(timeout=300, headers=AUTH) as http:
        run = asyncio.gather(*(complete(http, p) for p in prompts))
        for _ in range(100):  # until engine1 holds some of them (admitted, prefilling)
            if await held_by_engine1() > 0:
                break
            await asyncio.sleep(0.05)
        assert await held_by_engine1() > 0
        [scheduler] = [c for c in two_engines.stack.children if c.name == "scheduler.1"]
        two_engines.kill(scheduler, "scheduler", [
            "--nats-url", two_engines.url, "--engine-id", "engine1",
            *two_engines.argv["scheduler"]])
        results = await asyncio.wait_for(run, timeout=280)
    # Every request ends with its answer: engine1's moved to engine0, which served them all.
    assert all(r["status"] == 200 for r in results), results
    assert all(r["body"]["choices"][0]["finish_reason"] == "length" for r in results), results
    assert all(r["body"]["usage"]["completion_tokens"] == 4 for r in results), results


@pytest.mark.parametrize(("kind", "victim"), CASES)
async def test_a_stream_whose_engine_dies_resumes_on_the_other_engine(two_engines, victim,
                                                                      kind):
    """The detokenizer's case: the engine moves the stream to the other copy, which never
    got the tokens the dead copy lost; the api sees the gap and resumes the request from what
    its client has."""
    two_engines.restore()
    stack, base_url, url = two_engines.stack, two_engines.base_url, two_engines.url
    observer = stack.observer_url(url)
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
        if kind not in two_engines.undisturbed:  # the same for every victim
            two_engines.undisturbed[kind] = await _stream(http, base_url, REQUESTS[kind])
        undisturbed = two_engines.undisturbed[kind]
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
            engine = await engine_holding(observer)
            assert engine is not None, "the stream ended before the kill"
            [child] = [c for c in stack.children if c.name == f"{victim}.{engine[-1]}"]
            victim_argv = ["--nats-url", url, "--engine-id", engine,
                           *two_engines.argv.get(victim, [])]
        assert not stream.done(), "the stream ended before the kill"
        migrations = await _migrations(http, base_url)
        two_engines.kill(child, victim, victim_argv)
        moved = await asyncio.wait_for(stream, timeout=60)
        assert await _migrations(http, base_url) > migrations
    assert undisturbed["error"] is None and undisturbed["completion_tokens"] == MAX_TOKENS
    assert moved["error"] is None, moved
    assert moved["text"] == undisturbed["text"]  # nothing repeated, nothing lost
    assert (moved["finish_reason"], moved["completion_tokens"]) == ("length", MAX_TOKENS)


async def test_a_detokenizer_started_again_before_it_was_missed_loses_no_request(two_engines):
    """A detokenizer copy killed -9 and started again at once under its instance id (as a
    supervisor with fixed ids does), well within DEAD_AFTER, three times while short requests
    run: none hangs. The new start (another incarnation in its heartbeats) is taken as the
    death it is, and the requests whose text the dead process held resume. Before, those
    whose last text died with it waited for --request-timeout (8 of 49 in the first run)."""
    two_engines.restore()
    stack, base_url, url = two_engines.stack, two_engines.base_url, two_engines.url
    answered, hung = [], []
    stop = asyncio.get_running_loop().time() + 10

    async def ask(i: int) -> None:
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            while asyncio.get_running_loop().time() < stop:
                body = {"model": MODEL_NAME, "max_tokens": 3 + i % 5, "temperature": 0,
                        "messages": [{"role": "user", "content": f"Say {i} {len(answered)}"}]}
                try:
                    response = await http.post(f"{base_url}/chat/completions", json=body)
                    answered.append(response.status_code)
                except httpx.ReadTimeout:
                    hung.append(i)

    async def restart_a_detokenizer() -> None:
        for _ in range(3):
            await asyncio.sleep(2.5)
            child = next(c for c in stack.children if c.name.startswith("detokenizer"))
            instance = _replica(child)
            os.kill(child.process.pid, signal.SIGKILL)
            child.process.wait()
            stack.children.remove(child)
            stack.start_service("detokenizer", ["--nats-url", url, "--instance-id", instance],
                                child.name)

    await asyncio.gather(restart_a_detokenizer(), *(ask(i) for i in range(8)))
    assert hung == [] and answered and set(answered) == {200}, (hung, set(answered))

"""A client that leaves ends its work, streamed or not, on every route that generates or
embeds: the engine's running count is back to 0 soon after, and its KV blocks are free (or
held only by the prefix cache)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.stack import AUTH, MODEL_NAME, engine_stats

LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
HELLO = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
# 48 inputs of ~200 tokens: a few seconds of prefill in the exact mode, long enough to leave in.
TEXTS = [f"Sentence number {i} is about lighthouses, ships and the sea at night. " * 12
         for i in range(48)]
# An abort is one bus message to the scheduler, which frees the request at its next step; on
# a busy 2-core machine a step of the exact mode may take 100 ms. The issue asks for 1 s.
ABORTED_WITHIN = 1.0

ROUTES = [
    ("chat", "/chat/completions", {"messages": HELLO, **LONG}),
    ("completions", "/completions", {"prompt": "Once upon a time", **LONG}),
    ("responses", "/responses", {"input": "Tell me a long story.", "max_output_tokens": 1000,
                                 "ignore_eos": True, "temperature": 0}),
    ("messages", "/messages", {"messages": HELLO, "max_tokens": 1000, "ignore_eos": True,
                               "temperature": 0}),
    ("embeddings", "/embeddings", {"input": TEXTS}),
    ("score", "/score", {"text_1": TEXTS[0], "text_2": TEXTS}),
]


async def _busy(nats_url: str) -> bool:
    stats = await engine_stats(nats_url)
    return stats.num_running + stats.num_waiting > 0


async def _wait_until(condition, timeout: float) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    started = time.monotonic()
    while not await condition():
        assert time.monotonic() - started < timeout, "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def _settled(nats_url: str) -> None:
    await _wait_until(lambda: _idle(nats_url), 60)


async def _idle(nats_url: str) -> bool:
    return not await _busy(nats_url)


STREAMED = {"chat", "completions", "responses", "messages"}  # embeddings are never streamed
CASES = [(*route, stream) for route in ROUTES for stream in (False, True)
         if not stream or route[0] in STREAMED]


@pytest.mark.parametrize(("name", "path", "body", "stream"), CASES,
                         ids=[f"{c[0]}-{'streamed' if c[3] else 'collected'}" for c in CASES])
async def test_a_client_that_leaves_frees_its_work(stack, name, path, body, stream):
    await _settled(stack.nats_url)  # an earlier test's requests are not this one's
    body = {"model": MODEL_NAME, **body} | ({"stream": True} if stream else {})
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
        asking = asyncio.create_task(http.post(stack.base_url + path, json=body))
        await _wait_until(lambda: _busy(stack.nats_url), 60)
        asking.cancel()  # the connection closes with the client's task
        with pytest.raises(asyncio.CancelledError):
            await asking
    assert await _wait_until(lambda: _idle(stack.nats_url), 30) < ABORTED_WITHIN
    after = await engine_stats(stack.nats_url)
    assert after.num_free_blocks + after.num_cached_blocks == after.num_total_blocks


async def test_a_responses_answer_whose_client_left_is_not_stored(stack):
    body = {"model": MODEL_NAME, "input": "Tell me a long story.", "max_output_tokens": 1000,
            "ignore_eos": True, "temperature": 0, "stream": True}
    await _settled(stack.nats_url)
    response_id = None
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
        async with http.stream("POST", stack.base_url + "/responses", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    if event["type"] == "response.created":
                        response_id = event["response"]["id"]
                    if event["type"] == "response.output_text.delta":
                        break  # and leave
        await _wait_until(lambda: _idle(stack.nats_url), 30)
        assert response_id is not None
        gone = await http.get(f"{stack.base_url}/responses/{response_id}")
    assert gone.status_code == 404, gone.text

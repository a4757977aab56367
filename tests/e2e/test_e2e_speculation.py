"""Speculative decoding through the whole stack (the small-KV stack: drafts on, and a KV budget
small enough to preempt, tests/conftest.py): greedy answers, stop strings, streaming and n > 1
come out as without them."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.stack import API_KEY, AUTH, MODEL_NAME, engine_stats

pytestmark = pytest.mark.model

PASSAGE = ("The lighthouse was built in 1871, after three ships were lost on the reef in one "
           "winter. Its first keeper climbed the ninety-two steps every evening to light the "
           "lamp.")
# Twelve at once need about 1,300 tokens of KV: the small stack's 656 preempt some of them.
QUESTIONS = [f"Repeat the following text exactly, {i + 1} times:\n\n{PASSAGE}"
             for i in range(12)]
MAX_TOKENS = 48


async def _answers(base_url: str, **extra) -> list[tuple[str, str]]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                  timeout=300) as client:

        async def ask(question: str) -> tuple[str, str]:
            reply = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                temperature=0, max_tokens=MAX_TOKENS, **extra)
            choice = reply.choices[0]
            return choice.message.content, choice.finish_reason

        return await asyncio.gather(*(ask(q) for q in QUESTIONS))


async def test_greedy_answers_and_stop_strings_are_those_without_drafts(stack, small_kv_stack):
    before = await engine_stats(small_kv_stack.nats_url)
    assert await _answers(small_kv_stack.base_url) == await _answers(stack.base_url)
    # a stop string inside a run of accepted drafts ends the text right there
    stopped = await _answers(small_kv_stack.base_url, stop=["steps"])
    assert stopped == await _answers(stack.base_url, stop=["steps"])
    assert all(reason == "stop" and "steps" not in text for text, reason in stopped)
    after = await engine_stats(small_kv_stack.nats_url)
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    print(f"drafts {after.num_draft_tokens - before.num_draft_tokens}, accepted {accepted}, "
          f"preemptions {after.num_preemptions - before.num_preemptions}")
    assert accepted > 50 and after.num_preemptions > before.num_preemptions
    assert after.num_running == 0 and after.num_free_blocks + after.num_cached_blocks \
        == after.num_total_blocks


async def test_streaming_n_and_metrics_with_drafts(small_kv_stack):
    body = {"model": MODEL_NAME, "stream": True, "n": 2, "temperature": 0.7, "seed": 3,
            "max_tokens": 40, "messages": [{"role": "user", "content": QUESTIONS[2]}]}
    texts, reasons = ["", ""], [None, None]
    async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:
        async with client.stream("POST", f"{small_kv_stack.base_url}/chat/completions",
                                 json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
                    reasons[choice["index"]] = choice["finish_reason"] or reasons[
                        choice["index"]]
        metrics = (await client.get(small_kv_stack.base_url.removesuffix("/v1") + "/metrics")).text
    assert all(texts) and all(r in ("stop", "length") for r in reasons)
    accepted = [line for line in metrics.splitlines()
                if line.startswith("llmbus:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0
    assert "llmbus:spec_decode_draft_acceptance_rate" in metrics

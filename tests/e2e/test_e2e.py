"""The whole pipeline through `llmbus up`: real nats-server, real model, real HTTP clients."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.hf_reference import hf_greedy
from tests.stack import API_KEY, AUTH, MODEL_NAME, engine_stats

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1492, Columbus",
]
MAX_TOKENS = 24


def _expected(hf_reference, prompt_ids: list[int]) -> tuple[str, str, int]:
    """(text, finish_reason, completion token count) that greedy decoding must give."""
    tokenizer, _ = hf_reference
    ids = hf_greedy(hf_reference, prompt_ids, MAX_TOKENS)
    finish = "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(ids, skip_special_tokens=True), finish, len(ids)


def _chat_ids(hf_reference, question: str) -> list[int]:
    tokenizer, _ = hf_reference
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_greedy_matches_transformers(client, hf_reference, question):
    text, finish, num_tokens = _expected(hf_reference, _chat_ids(hf_reference, question))
    messages = [{"role": "user", "content": question}]

    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish
    assert reply.usage.completion_tokens == num_tokens
    assert reply.usage.prompt_tokens == len(_chat_ids(hf_reference, question))

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices]
    assert "".join(part or "" for part in content) == text
    assert len([part for part in content if part]) > 1  # streamed piece by piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == num_tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_matches_transformers(client, hf_reference, prompt):
    tokenizer, _ = hf_reference
    text, finish, num_tokens = _expected(hf_reference, tokenizer.encode(prompt))

    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                      max_tokens=MAX_TOKENS)
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == finish
    assert reply.usage.completion_tokens == num_tokens

    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True))
    assert streamed == text


def test_curl_style_sse_stream(stack):
    """The README's request, read as raw SSE lines."""
    body = {"model": MODEL_NAME, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body,
                      headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert len(lines) > 3


async def test_concurrent_streams_share_steps(stack):
    """Eight concurrent streaming requests finish correctly and decode in shared steps."""
    questions = [f"Count from {i} to {i + 5}." for i in range(8)]
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0,
                                timeout=120)  # closed at the end: see test_e2e_preemption

    async def ask(question: str, stream: bool) -> tuple[str, str]:
        messages = [{"role": "user", "content": question}]
        if not stream:
            reply = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, temperature=0, max_tokens=16)
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        parts, finish = [], None
        async for chunk in await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, temperature=0, max_tokens=16,
                stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async with client:
        alone = [await ask(q, stream=False) for q in questions]
        before = await engine_stats(stack.nats_url)
        together = await asyncio.gather(*(ask(q, stream=True) for q in questions))
        after = await engine_stats(stack.nats_url)

    assert together == alone
    num_steps = after.num_steps - before.num_steps
    num_tokens = sum(len(t) for t, _ in together)  # a loose upper bound is enough here
    assert after.max_batch_size >= 4
    assert num_steps < num_tokens
    assert after.num_running == 0 and after.num_waiting == 0
    # No KV block leaked: each is free or held only by the prefix cache.
    assert after.num_free_blocks + after.num_cached_blocks == after.num_total_blocks


def test_a_lone_stream_gets_its_tokens_as_the_forwards_sample_them(client):
    """A lone stream decodes 8 forwards a plan (multi-step; the shared stack's plan time fits
    them), yet its tokens come as the forwards sample them (StepProgress, at most every 16 ms),
    not a plan's worth at a time: an exact forward reads the model's 540 MB of float32 weights,
    8 ms or more at any 2-core machine's bandwidth, so at most two forwards end within one
    interval, and most chunks carry one or two tokens (the logprobs say how many each carries)
    where a plan's worth is 8. Seen failing without the executor's grant to publish its
    progress."""
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                       max_tokens=160, temperature=0, logprobs=1, stream=True,
                                       extra_body={"ignore_eos": True})
    per_chunk = [len(c.choices[0].logprobs.tokens) for c in stream
                 if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert sum(per_chunk) == 160
    assert sorted(per_chunk)[len(per_chunk) // 2] <= 2, per_chunk

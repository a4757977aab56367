"""OpenAI parameters through the running stack, asked with the official SDK, checked for what
they must do."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import openai
import pytest

from tests.stack import API_KEY, AUTH, MODEL_NAME, engine_stats, processes_mentioning

pytestmark = pytest.mark.model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs.setdefault("messages", FRANCE)
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def test_stop_string_is_cut_and_ends_with_stop(client):
    reply = chat(client, temperature=0, stop=[" Paris"])
    assert reply.choices[0].message.content == "The capital of France is"
    assert reply.choices[0].finish_reason == "stop"
    kept = chat(client, temperature=0, stop=" Paris", extra_body={
        "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "The capital of France is Paris"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, temperature=0, stop=["France is"], stream=True) if c.choices)
    assert streamed == "The capital of "


def test_n_choices_are_indexed_and_distinct(client):
    reply = chat(client, n=4, temperature=1.0, seed=7, max_tokens=12,
                 messages=[{"role": "user", "content": "Name a random animal."}])
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in reply.choices}) > 1
    streamed: dict[int, str] = {}
    for chunk in chat(client, n=3, temperature=0, max_tokens=8, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (
                choice.delta.content or "")
    assert sorted(streamed) == [0, 1, 2]
    assert len(set(streamed.values())) == 1  # greedy: every completion is the same text


def test_same_seed_same_text_other_seed_other_text(client):
    ask = dict(temperature=1.0, max_tokens=24,
               messages=[{"role": "user", "content": "Write a short poem about rain."}])
    first = chat(client, seed=1234, **ask).choices[0].message.content
    again = chat(client, seed=1234, **ask).choices[0].message.content
    other = chat(client, seed=4321, **ask).choices[0].message.content
    assert first == again
    assert first != other


def test_logprobs_match_the_chosen_tokens(client):
    reply = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content if t.token != "<|im_end|>") == \
        reply.choices[0].message.content
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token  # greedy picks the most likely token
        assert math.isclose(tops[0].logprob, entry.logprob, abs_tol=1e-5)
        assert bytes(entry.bytes).decode() == entry.token
    completion = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                           temperature=0, max_tokens=4, logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_include_usage_sends_a_final_usage_chunk(client):
    chunks = list(chat(client, temperature=0, stream=True, max_tokens=5,
                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens_and_min_tokens(client):
    short = chat(client, temperature=0, max_completion_tokens=3)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3
    natural = chat(client, temperature=0).usage.completion_tokens
    longer = chat(client, temperature=0, max_tokens=40, extra_body={"min_tokens": natural + 4})
    assert longer.usage.completion_tokens >= natural + 4


def test_logit_bias_forces_a_token(client, stack):
    token = httpx.post(f"{stack.base_url.removesuffix('/v1')}/tokenize", headers=AUTH,
                       json={"prompt": " banana"}).json()["tokens"]
    assert len(token) == 1
    reply = chat(client, temperature=0, max_tokens=3, logit_bias={str(token[0]): 100})
    assert reply.choices[0].message.content == " banana" * 3


def test_batched_prompts_and_echo(client):
    reply = client.completions.create(model=MODEL_NAME, prompt=["One, two,", "Red, green,"],
                                      n=2, temperature=0, max_tokens=4)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text == reply.choices[1].text
    assert reply.choices[2].text == reply.choices[3].text
    assert reply.choices[0].text != reply.choices[2].text
    echoed = client.completions.create(model=MODEL_NAME, prompt="One, two,", temperature=0,
                                       max_tokens=4, echo=True)
    assert echoed.choices[0].text == "One, two," + reply.choices[0].text


def test_tokenize_detokenize_version(stack):
    root = stack.base_url.removesuffix("/v1")
    tokens = httpx.post(f"{root}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 8192
    text = httpx.post(f"{root}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat_tokens = httpx.post(f"{root}/tokenize", json={"messages": FRANCE}).json()
    assert chat_tokens["count"] > tokens["count"]
    assert httpx.get(f"{root}/version").json()["version"]


def test_the_api_key_is_on_no_service_command_line(stack):
    """`llmbus up --api-key K` hands K to the api through its environment: `ps` shows it only
    on the launcher's own command line, where the user typed it."""
    assert processes_mentioning(API_KEY) == [stack.process.pid]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY},
                                     # non-ASCII bytes once made compare_digest raise: 500
                                     {"Authorization": "Bearer clé".encode()}],
                         ids=["none", "wrong", "no scheme", "non-ASCII"])
def test_v1_routes_need_the_api_key(stack, headers):
    response = httpx.post(f"{stack.base_url}/chat/completions", headers=headers,
                          json={"model": MODEL_NAME, "messages": FRANCE})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{stack.base_url.removesuffix('/v1')}/health").status_code == 200


async def test_client_disconnect_aborts_and_frees_blocks(stack):
    before = await engine_stats(stack.nats_url)
    body = {"model": MODEL_NAME, "messages": FRANCE, "stream": True, "max_tokens": 4000,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{stack.base_url}/chat/completions", json=body,
                               headers=AUTH) as response:
            lines = response.aiter_lines()
            for _ in range(6):
                await anext(lines)
            during = await engine_stats(stack.nats_url)
            assert during.num_running == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = await engine_stats(stack.nats_url)
        if after.num_running == 0:
            break
        await asyncio.sleep(0.1)
    assert after.num_running == 0 and after.num_waiting == 0
    assert after.num_free_blocks + after.num_cached_blocks == after.num_total_blocks
    assert after.num_finished == before.num_finished + 1

"""A thinking qwen3 model (generated: tests/thinking_model.py) served by the whole stack:
its reasoning comes back as `reasoning_content`, its answer as `content`, streamed and not,
read by the openai SDK; also where the prompt itself opened the think block (DeepSeek-R1's
template ends in `<think>`). `chat_template_kwargs` reach the template (`enable_thinking: false`
closes the block).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.stack import needs_default_model
from tests.thinking_model import ANSWER, REASONING

pytestmark = [pytest.mark.model, needs_default_model()]

def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url(0), api_key="unused", max_retries=0,
                         timeout=120)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_reasoning_and_answer_come_apart(thinking_stack):
    client = _client(thinking_stack)
    [model] = client.models.list().data
    reply = client.chat.completions.create(model=model.id, messages=QUESTION, temperature=0,
                                           max_tokens=30)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    assert reply.choices[0].finish_reason == "stop"


def test_reasoning_streams_before_the_answer(thinking_stack):
    client = _client(thinking_stack)
    [model] = client.models.list().data
    parts = []
    for chunk in client.chat.completions.create(model=model.id, messages=QUESTION,
                                                temperature=0, max_tokens=30, stream=True):
        delta = chunk.choices[0].delta
        for field in ("reasoning_content", "content"):
            if getattr(delta, field, None):
                parts.append((field, getattr(delta, field)))
    fields = [field for field, _ in parts]
    assert fields == sorted(fields, key=("reasoning_content", "content").index)  # in order
    assert "".join(t for f, t in parts if f == "reasoning_content") == REASONING
    assert "".join(t for f, t in parts if f == "content") == ANSWER
    assert not any("think>" in t for _, t in parts)


def test_a_prompt_that_opened_the_think_block(thinking_stack):
    client = _client(thinking_stack)
    [model] = client.models.list().data
    reply = client.chat.completions.create(
        model=model.id, messages=QUESTION, temperature=0, max_tokens=30,
        extra_body={"chat_template_kwargs": {"opened": True}})
    message = reply.choices[0].message  # the output begins inside the block: no <think>
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)


def test_chat_template_kwargs_reach_the_template(thinking_stack):
    base = thinking_stack.base_url(1).removesuffix("/v1")

    def prompt(**kwargs) -> str:
        tokens = httpx.post(f"{base}/tokenize", timeout=30, json={
            "messages": QUESTION, **kwargs}).json()["tokens"]
        return httpx.post(f"{base}/detokenize", timeout=30,
                          json={"tokens": tokens}).json()["prompt"]

    # (decoded without the special tokens: <|im_start|> is one, <think> is not)
    assert prompt().endswith("France?\nassistant\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
        "France?\nassistant\n<think>\n\n</think>\n\n")
    refused = httpx.post(f"{base}/tokenize", timeout=30, json={
        "messages": QUESTION, "chat_template_kwargs": {"messages": []}})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "`chat_template_kwargs` may not set `messages`"


def test_structured_output_constrains_the_answer_not_the_reasoning(thinking_stack):
    """A choice constraint on a thinking model: the reasoning is written freely, the answer
    after `</think>` is one of the choices; with thinking off (the template closed the think
    block) the constraint holds from the first token."""
    client = _client(thinking_stack)
    [model] = client.models.list().data
    choices = {"guided_choice": ["Paris", "Rome"]}
    reply = client.chat.completions.create(model=model.id, messages=QUESTION, temperature=0,
                                           max_tokens=30, extra_body=choices)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, "Paris")
    off = client.chat.completions.create(
        model=model.id, messages=QUESTION, temperature=0, max_tokens=30,
        extra_body={**choices, "chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message
    assert message.reasoning_content is None and message.content in ("Paris", "Rome")

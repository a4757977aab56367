"""Anthropic's Messages API through the whole stack, read by the official `anthropic` SDK: the
generated thinking model (tests/thinking_model.py) for thinking blocks, streaming, the budget,
count_tokens and the errors; the default model (exact mode) for a tool_use / tool_result round
trip, with the shared stack's API key sent as `x-api-key`."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.stack import API_KEY, MODEL_NAME, needs_default_model
from tests.thinking_model import ANSWER, REASONING

pytestmark = [pytest.mark.model, needs_default_model()]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the 2.x SDK sends sampling in the body


def _client(base_url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key,
                               max_retries=0, timeout=120)


def _model(base_url: str) -> str:
    return httpx.get(f"{base_url}/models", timeout=30).json()["data"][0]["id"]


def test_create_returns_thinking_then_text(thinking_stack):
    base_url = thinking_stack.base_url(0)
    client, model = _client(base_url), _model(base_url)
    message = client.messages.create(model=model, max_tokens=30, messages=QUESTION, **GREEDY)
    thinking, text = message.content
    assert (thinking.type, thinking.thinking, text.type, text.text) == (
        "thinking", REASONING, "text", ANSWER)
    assert message.id.startswith("msg_") and message.model == model
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    counted = client.messages.count_tokens(model=model, messages=QUESTION)
    usage = message.usage  # input tokens: those computed, beside those the cache held
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens > 0
    assert message.usage.output_tokens > 0


def test_stream_events_accumulate_into_the_same_message(thinking_stack):
    base_url = thinking_stack.base_url(1)
    client, model = _client(base_url), _model(base_url)
    # a budget the thinking fits in changes nothing
    with client.messages.stream(model=model, max_tokens=30, messages=QUESTION, **GREEDY,
                                thinking={"type": "enabled", "budget_tokens": 20}) as stream:
        kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None))
                 for event in stream]
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (REASONING, ANSWER)
    assert message.stop_reason == "end_turn" and message.usage.output_tokens > 0
    raw = [kind for kind, _ in kinds if kind in ("message_start", "message_delta",
                                                 "message_stop")]
    assert raw == ["message_start", "message_delta", "message_stop"]
    deltas = [delta for kind, delta in kinds if kind == "content_block_delta"]
    assert deltas == sorted(deltas, key=("thinking_delta", "text_delta").index)
    assert {"thinking_delta", "text_delta"} <= set(deltas)


def test_the_thinking_budget_caps_the_thinking(thinking_stack):
    """A budget of 3 tokens, where the model thinks for 4 (`<think>` and three): the
    generation ends in its thinking with no answer. The pipeline delivers several tokens per
    delta (multi-step decoding) and the cut drops the whole delta that passes the budget, so
    what thinking is shown is a part of the reasoning, maybe none of it."""
    base_url = thinking_stack.base_url(0)
    client, model = _client(base_url), _model(base_url)
    message = client.messages.create(model=model, max_tokens=30, messages=QUESTION,
                                     thinking={"type": "enabled", "budget_tokens": 3}, **GREEDY)
    for block in message.content:
        assert block.type == "thinking"
        assert REASONING.startswith(block.thinking) and block.thinking != REASONING
    assert message.stop_reason == "max_tokens"


def test_bad_requests_get_anthropic_errors(thinking_stack):
    base_url = thinking_stack.base_url(1)
    client, model = _client(base_url), _model(base_url)
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.messages.create(model=model, max_tokens=anthropic.omit, messages=QUESTION)
    assert missing.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    orphan = [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "21 degrees"}]}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=model, max_tokens=10, messages=orphan)
    assert refused.value.body["type"] == "error"
    assert "toolu_nope" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-nope", max_tokens=10, messages=QUESTION)
    assert unknown.value.body["error"]["type"] == "not_found_error"


WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 40}},
               "required": ["city"], "additionalProperties": False}}


def test_a_tool_use_and_its_result(stack):
    client = _client(stack.base_url, API_KEY)  # sent as x-api-key
    turns = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    called = client.messages.create(
        model=MODEL_NAME, max_tokens=40, messages=turns, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    assert called.stop_reason == "tool_use"
    [tool_use] = [block for block in called.content if block.type == "tool_use"]
    assert tool_use.name == "get_weather" and isinstance(tool_use.input["city"], str)
    assert tool_use.id.startswith("toolu_")
    counted = [client.messages.count_tokens(model=MODEL_NAME, messages=turns, **tools)
               for tools in ({"tools": [WEATHER]}, {})]  # the tools' prompt is counted too
    usage = called.usage  # input tokens: those computed, beside those the cache held
    assert (usage.input_tokens + usage.cache_read_input_tokens == counted[0].input_tokens
            > counted[1].input_tokens)
    turns += [{"role": "assistant", "content": called.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                            "content": "21 degrees, sunny"}]}]
    answered = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=turns,
                                      tools=[WEATHER], tool_choice={"type": "none"}, **GREEDY)
    assert answered.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answered.content] == ["text"]
    assert answered.content[0].text
    with pytest.raises(anthropic.AuthenticationError) as denied:
        _client(stack.base_url, "wrong-key").messages.create(
            model=MODEL_NAME, max_tokens=5, messages=turns[:1])
    assert denied.value.body["error"]["type"] == "authentication_error"


def test_a_prefill_is_continued(stack):
    """A final assistant message is the start of the answer, as Anthropic documents: the
    default model's greedy answer is "The capital of France is Paris.", so the prefill
    "The capital of France is" goes on with " Paris." (and only that comes back)."""
    client = _client(stack.base_url, API_KEY)
    turns = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    message = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=turns, **GREEDY)
    assert message.content[0].text == " Paris."
    assert message.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=turns).input_tokens
    plain = client.messages.count_tokens(model=MODEL_NAME, messages=QUESTION).input_tokens
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted > plain

"""OpenAI's Responses API through the official openai SDK: reasoning items and the typed
event stream (the generated thinking model, two api copies), stored responses continued on the
other copy and after the writer restarts, a function tool round trip and `text.format` parsed
with pydantic (the default model), and the dialect's errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.stack import API_KEY, MODEL_NAME
from tests.thinking_model import ANSWER, REASONING

pytestmark = pytest.mark.model

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 40},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}


class City(BaseModel, extra="forbid"):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


def _client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_reasoning_item_then_the_answer(thinking_stack):
    client = _client(thinking_stack.base_url(0))
    response = client.responses.create(model=_model(client), input=QUESTION,
                                       max_output_tokens=30, temperature=0)
    assert response.status == "completed" and response.object == "response"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0


def test_the_stream_sends_the_documented_events_in_order(thinking_stack):
    client = _client(thinking_stack.base_url(1))
    with client.responses.stream(model=_model(client), input=QUESTION,
                                 max_output_tokens=30, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text) == (REASONING, ANSWER)
    assert final.output_text == ANSWER and final.usage.output_tokens > 0


def _prompt_tokens(base_url: str, messages: list[dict]) -> int:
    reply = httpx.post(base_url.removesuffix("/v1") + "/tokenize", timeout=30,
                       json={"messages": messages})
    return reply.json()["count"]


def test_a_stored_response_goes_on_at_the_other_copy_and_after_a_restart(thinking_stack):
    """Copy 0 writes, copy 1 reads and continues; copy 0 restarts and still continues it; a
    deleted response is gone for both."""
    first, second = (_client(thinking_stack.base_url(i)) for i in (0, 1))
    model = _model(first)
    one = first.responses.create(model=model, input=QUESTION, max_output_tokens=30,
                                 temperature=0, metadata={"case": "stored"})
    assert second.responses.retrieve(one.id).output_text == ANSWER
    two = second.responses.create(model=model, input="And of Italy?", temperature=0,
                                  previous_response_id=one.id, max_output_tokens=30)
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": ANSWER},
                    {"role": "user", "content": "And of Italy?"}]
    assert two.usage.input_tokens == _prompt_tokens(thinking_stack.base_url(1), conversation)
    assert two.previous_response_id == one.id and one.metadata == {"case": "stored"}

    thinking_stack.restart(0)
    first = _client(thinking_stack.base_url(0))
    assert first.responses.retrieve(two.id).output_text == ANSWER
    three = first.responses.create(model=model, input="And of Spain?", temperature=0,
                                   previous_response_id=two.id, max_output_tokens=30)
    conversation += [{"role": "assistant", "content": ANSWER},
                     {"role": "user", "content": "And of Spain?"}]
    assert three.usage.input_tokens == _prompt_tokens(thinking_stack.base_url(0), conversation)

    second.responses.delete(one.id)
    with pytest.raises(openai.NotFoundError):
        first.responses.retrieve(one.id)


def test_unknown_previous_response_and_unstored_ones_are_404(thinking_stack):
    client = _client(thinking_stack.base_url(0))
    model = _model(client)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=model, input="Hi", previous_response_id="resp_" + "0" * 32)
    error = caught.value.body
    assert error["param"] == "previous_response_id"
    assert error["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=model, input=QUESTION, store=False,
                                       max_output_tokens=30)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_bad_input_gets_the_openai_error_shape(thinking_stack):
    client = _client(thinking_stack.base_url(1))
    model = _model(client)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input=[
            {"type": "function_call_output", "call_id": "call_x", "output": "21 degrees"}])
    assert "call_x" in caught.value.body["message"] and caught.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="Hi", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools"


def test_a_function_tool_round_trip(stack):
    client = _client(stack.base_url, API_KEY)
    called = client.responses.create(
        model=MODEL_NAME, input="What is the weather like in Paris today?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=60)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    answered = client.responses.create(
        model=MODEL_NAME, previous_response_id=called.id, tools=[WEATHER], temperature=0,
        max_output_tokens=20, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "21 degrees and sunny"}])
    assert answered.output[-1].type == "message" and answered.output_text


def test_text_format_json_schema_parses_with_pydantic(stack):
    client = _client(stack.base_url, API_KEY)
    parsed = client.responses.parse(model=MODEL_NAME, input="Name a city and its country.",
                                    text_format=City, temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, City)

"""Structured output and tool calling through the whole stack, with the openai SDK and the
default model: every API form gives valid output every time, bad constraints get a 400 naming
the parameter, and constrained requests survive preemption."""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.stack import API_KEY, AUTH, MODEL_NAME, engine_stats

pytestmark = pytest.mark.model

SUBJECTS = ["a baker", "a pilot", "a chess player", "a gardener", "a nurse", "a painter",
            "a fisherman", "a teacher", "a drummer", "a librarian", "a chef", "a farmer",
            "a sailor", "a poet", "a mechanic", "a dancer", "a doctor", "a miner", "a judge",
            "a clown"]


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel, extra="forbid"):
    city: str = Field(max_length=40)
    zip_code: str = Field(pattern="^[0-9]{5}$")


class Person(BaseModel, extra="forbid"):  # no other keys (additionalProperties: false)
    """Six fields: a bounded string, integer bounds, an enum, a nested object, a bounded list
    and an optional. Strings and the list are bounded, as a small model needs: unbounded, it
    may write one hobby forever, where the schema allows that."""

    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    favorite_color: Color
    address: Address
    hobbies: list[Annotated[str, Field(max_length=30)]] = Field(max_length=3)
    nickname: str | None = Field(max_length=20)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


class WeatherArgs(BaseModel, extra="forbid"):
    city: str
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=300)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def test_sdk_parse_returns_a_valid_object_every_time(stack):
    settings = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1}]
    subjects = SUBJECTS[:10]  # 20 whole objects, greedy and sampled (40 took 10 s more)
    async with client(stack.base_url) as sdk:
        async def parse(subject: str, extra: dict):
            reply = await sdk.beta.chat.completions.parse(
                model=MODEL_NAME, messages=user(f"Describe {subject} as a person."),
                response_format=Person, max_tokens=300, **extra)
            return reply.choices[0].message.parsed

        people = await asyncio.gather(*(parse(s, extra) for extra in settings
                                        for s in subjects))
    assert len(people) == 2 * len(subjects) and all(isinstance(p, Person) for p in people)
    # Sampling varies what they say: more distinct people than the greedy ones alone.
    assert len({p.model_dump_json() for p in people}) > len(subjects)


async def test_json_object_regex_and_choice_always_match(stack):
    async with client(stack.base_url) as sdk:
        async def json_object(subject: str) -> str:
            reply = await sdk.chat.completions.create(
                # as OpenAI's docs ask, the prompt asks for JSON (a 135M model told nothing
                # more goes on adding keys until max_tokens)
                model=MODEL_NAME, messages=user(f"Describe {subject} in a JSON object with "
                                                "the keys name, job and age."),
                response_format={"type": "json_object"}, max_tokens=200, temperature=0)
            return reply.choices[0].message.content

        async def phone(seed: int) -> str:
            reply = await sdk.completions.create(
                model=MODEL_NAME, prompt="Call me at", max_tokens=20, temperature=1.0,
                seed=seed, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
            return reply.choices[0].text

        async def choice(subject: str) -> str:
            reply = await sdk.chat.completions.create(
                model=MODEL_NAME, messages=user(f"Is {subject} a job?"), max_tokens=10,
                temperature=1.0, extra_body={"guided_choice": ["yes", "no", "it depends"]})
            return reply.choices[0].message.content

        objects, phones, choices = await asyncio.gather(
            asyncio.gather(*(json_object(s) for s in SUBJECTS[:10])),  # the long answers
            asyncio.gather(*(phone(seed) for seed in range(20))),
            asyncio.gather(*(choice(s) for s in SUBJECTS)))
    assert all(isinstance(json.loads(text), dict) for text in objects)
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text) for text in phones)
    assert set(choices) <= {"yes", "no", "it depends"} and len(choices) == 20


async def test_guided_json_on_completions(stack):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    async with client(stack.base_url) as sdk:
        reply = await sdk.completions.create(
            model=MODEL_NAME, prompt="What is 6 times 7? Answer in JSON:", max_tokens=20,
            temperature=0, extra_body={"guided_json": schema})
    assert set(json.loads(reply.choices[0].text)) == {"answer"}
    assert reply.choices[0].finish_reason == "stop"


async def test_grammar_in_gbnf_and_lark(stack):
    async with client(stack.base_url) as sdk:
        for grammar in ('root ::= "The answer is " [0-9]+ "."',  # GBNF
                        'start: "The answer is " /[0-9]+/ "."'):  # Lark
            reply = await sdk.completions.create(
                model=MODEL_NAME, prompt="What is 6 times 7?", max_tokens=12, temperature=0,
                extra_body={"guided_grammar": grammar})
            assert re.fullmatch(r"The answer is \d+\.", reply.choices[0].text)


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_required_and_named_tool_calls_are_valid_streamed_or_not(stack, tool_choice):
    async with client(stack.base_url) as sdk:
        request = {"model": MODEL_NAME, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
                   "max_tokens": 100, "temperature": 0,
                   "messages": user("What is the weather like in Paris today?")}
        reply = await sdk.chat.completions.create(**request)
        async with sdk.beta.chat.completions.stream(**request) as stream:
            streamed = await stream.get_final_completion()
    for choice in (reply.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls" and choice.message.content in (None, "")
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if call.function.name == "get_weather":
                WeatherArgs.model_validate_json(call.function.arguments)
            else:
                assert tool_choice == "required" and call.function.name == "get_time"
    assert [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls
            ] == [(c.function.name, c.function.arguments)
                  for c in streamed.choices[0].message.tool_calls]
    if isinstance(tool_choice, dict):
        assert {c.function.name for c in reply.choices[0].message.tool_calls} == {"get_weather"}


async def test_a_conversation_with_calls_and_tool_results_goes_on(stack):
    messages = [*user("What is the weather in Paris?"),
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    async with client(stack.base_url) as sdk:
        reply = await sdk.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=[WEATHER], max_tokens=30, temperature=0)
        plain = await sdk.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=[WEATHER], tool_choice="none",
            max_tokens=30, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


async def test_max_tokens_mid_structure_ends_with_length(stack):
    async with client(stack.base_url) as sdk:
        reply = await sdk.chat.completions.create(
            model=MODEL_NAME, messages=user("Describe a pilot."), max_tokens=5, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": Person.model_json_schema()}})
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format", "objekt"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice", "tool_choice"),
    ({"guided_regex": "[a-z]+", "min_tokens": 3}, "min_tokens", "min_tokens"),
])
async def test_bad_constraints_get_a_400_naming_the_parameter(stack, body, param, says):
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
        response = await http.post(f"{stack.base_url}/chat/completions", json={
            "model": MODEL_NAME, "messages": user("hi"), **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


async def test_tools_on_completions_are_refused(stack):
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
        response = await http.post(f"{stack.base_url}/completions", json={
            "model": MODEL_NAME, "prompt": "hi", "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


async def test_constrained_requests_survive_preemption(small_kv_stack):
    # Eight of these at once need about 80 blocks (the story's ~5 shared, then ~9 each of
    # their own): the stack's 40 hold about half of them, so some are preempted.
    before = await engine_stats(small_kv_stack.nats_url)
    schema = Person.model_json_schema()
    story = "Our town has many people with long histories, jobs, homes and hobbies. " * 4
    async with client(small_kv_stack.base_url) as sdk:
        async def ask(subject: str) -> str:
            reply = await sdk.chat.completions.create(
                model=MODEL_NAME, messages=user(f"{story}\nDescribe {subject}."),
                max_tokens=250, temperature=1.0, seed=7, response_format={
                    "type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
            return reply.choices[0].message.content

        texts = await asyncio.gather(*(ask(s) for s in SUBJECTS[:8]))
    for text in texts:
        Person.model_validate_json(text)
    after = await engine_stats(small_kv_stack.nats_url)
    assert after.num_preemptions > before.num_preemptions

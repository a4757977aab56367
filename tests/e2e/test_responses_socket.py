"""The Responses API's WebSocket mode through the whole stack, driven by the openai SDK's
`responses.connect()`: turns one after another on one socket (the second continuing the
first by `previous_response_id`), a bad turn answered by an `error` event without closing the
socket, and a socket closed mid-turn aborting its work."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
import websockets

from tests.stack import API_KEY, MODEL_NAME, engine_stats


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def _turn(connection) -> list:
    """The events of one turn, up to its end (completed, incomplete, failed or an error)."""
    events = []
    for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed",
                          "error"):
            return events
    raise AssertionError("the socket closed mid-turn")


def test_turns_on_one_socket(stack):
    client = _client(stack)
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL_NAME, input="What is the capital of France?",
                                   temperature=0, max_output_tokens=12)
        first = _turn(connection)
        assert first[0].type == "response.created" and first[-1].type == "response.completed"
        text = "".join(e.delta for e in first if e.type == "response.output_text.delta")
        assert "Paris" in text
        done = first[-1].response
        assert done.output[0].content[0].text == text
        connection.response.create(model=MODEL_NAME, input="Say it again.", temperature=0,
                                   max_output_tokens=8, previous_response_id=done.id)
        second = _turn(connection)
        assert second[-1].response.previous_response_id == done.id
        # A bad turn: an error event, and the socket serves the next one.
        connection.response.create(model=MODEL_NAME, input="", max_output_tokens=4)
        [error] = _turn(connection)
        assert error.type == "error" and error.param == "input"
        connection.response.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
        assert _turn(connection)[-1].type == "response.incomplete"
    stored = client.responses.retrieve(done.id)
    assert stored.output[0].content[0].text == text


async def test_a_socket_closed_mid_turn_frees_its_work(stack):
    url = stack.base_url.replace("http://", "ws://") + "/responses"
    async with websockets.connect(url, additional_headers={
            "Authorization": f"Bearer {API_KEY}"}) as socket:
        await socket.send(json.dumps({
            "type": "response.create", "model": MODEL_NAME, "input": "Tell me a long story.",
            "max_output_tokens": 1000, "ignore_eos": True, "temperature": 0}))
        while json.loads(await socket.recv())["type"] != "response.output_text.delta":
            pass
    started = time.monotonic()
    while (stats := await engine_stats(stack.nats_url)).num_running:
        assert time.monotonic() - started < 30
        await asyncio.sleep(0.05)
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


@pytest.mark.parametrize("event", [{"type": "response.steer"},
                                   {"type": "response.create", "stream": True}])
async def test_what_the_socket_does_not_take_is_an_error_event(stack, event):
    url = stack.base_url.replace("http://", "ws://") + "/responses"
    async with websockets.connect(url, additional_headers={
            "Authorization": f"Bearer {API_KEY}"}) as socket:
        await socket.send(json.dumps({"model": MODEL_NAME, "input": "Hi", **event}))
        error = json.loads(await socket.recv())
    assert error["type"] == "error" and error["status"] == 400 and error["param"]

"""The Responses API's translations, both ways, without a stack: a body into the chat request
the one generation path serves, chat chunks into the typed events in their documented order."""

from __future__ import annotations

import msgspec
import pytest

from llmbus.services.api.bodies import decode_body
from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.responses_output import ResponseEvents, conversation_turn, output_items
from llmbus.services.api.responses_schema import ResponsesRequest, chat_request, input_messages

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _request(**body) -> ResponsesRequest:
    return msgspec.convert({"model": "m", "input": "Hi", **body}, ResponsesRequest)


def _roles(messages) -> list[tuple]:
    return [(m.role, m.content, [c.id for c in m.tool_calls or []], m.tool_call_id)
            for m in messages]


def test_input_items_become_chat_messages():
    messages = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier thinking: left out
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "developer", "content": "Be brief."}])
    assert _roles(messages) == [
        ("user", "Weather in Paris?", [], None),
        ("assistant", None, ["call_1", "call_2"], None),  # consecutive calls: one turn
        ("tool", "sunny", [], "call_1"), ("developer", "Be brief.", [], None)]


@pytest.mark.parametrize("items, needle", [
    ([], "must not be empty"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input_image"),
    ([{"type": "web_search_call"}], "web_search_call"),
    ([{"role": "robot", "content": "x"}], "robot"),
    ([{"type": "function_call", "name": "f"}], "call_id")])
def test_bad_input_items_are_400s_naming_them(items, needle):
    with pytest.raises(OpenAIError) as caught:
        input_messages(items)
    assert caught.value.status_code == 400 and needle in caught.value.message
    assert caught.value.param == "input"


def test_a_turn_is_instructions_history_and_input():
    history = input_messages("Earlier question")
    chat, conversation = chat_request(_request(
        instructions="Answer in French.", max_output_tokens=7, temperature=0.5,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        reasoning={"effort": "none"}), history)
    assert _roles(chat.messages) == [("system", "Answer in French.", [], None),
                                     ("user", "Earlier question", [], None),
                                     ("user", "Hi", [], None)]
    assert conversation == chat.messages[1:]  # the next turn does not inherit instructions
    assert (chat.max_tokens, chat.temperature) == (7, 0.5)
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}
    assert chat.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("body, param", [
    ({"include": ["message.output_text.logprobs"]}, "include"), ({"background": True},
                                                                   "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input")])
def test_what_chat_cannot_do_is_refused(body, param):
    with pytest.raises(OpenAIError) as caught:
        chat_request(_request(**body), [])
    assert caught.value.status_code == 400 and caught.value.param == param


def test_an_unknown_field_is_refused_not_ignored():
    with pytest.raises(OpenAIError) as caught:
        decode_body(b'{"model": "m", "input": "Hi", "max_tokens": 5}', ResponsesRequest)
    assert caught.value.status_code == 400 and "max_tokens" in caught.value.message


def _chunk(reason=None, **delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}


def test_chunks_become_events_in_order_with_one_id_per_item():
    events = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    out = events.start()
    for chunk in (_chunk(role="assistant", content=""), _chunk(reasoning_content="Let "),
                  _chunk(reasoning_content="me"), _chunk(content="Par"),
                  _chunk(content="is.", reason="length")):
        out += events.chunk(chunk)
    out += events.finish({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})
    out.append(events.completed())
    kinds = [kind for kind, _ in out]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert [body["sequence_number"] for _, body in out] == list(range(len(out)))
    reasoning_ids = {body.get("item_id") or body["item"]["id"] for _, body in out[2:7]}
    message_ids = {body.get("item_id") or body["item"]["id"] for _, body in out[7:14]}
    assert len(reasoning_ids) == len(message_ids) == 1 and reasoning_ids != message_ids
    final = out[-1][1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Paris."
    assert final["usage"]["total_tokens"] == 9 and out[0][1]["response"]["output"] == []


def test_tool_calls_stream_as_function_call_items():
    events = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    out = events.chunk(_chunk(tool_calls=[dict(CALL, index=0)], reason="tool_calls"))
    assert [kind for kind, _ in out] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert out[1][1]["delta"] == CALL["function"]["arguments"]
    assert out[0][1]["item"]["arguments"] == "" and out[3][1]["item"]["call_id"] == "call_1"
    events.finish({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    assert events.response["status"] == "completed"


def test_a_failure_ends_the_stream_failed():
    events = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    events.chunk(_chunk(content="Par"))
    (error, body), (failed, final) = events.fail("engine lost")
    assert (error, body["message"]) == ("error", "engine lost")
    assert failed == "response.failed" and final["response"]["status"] == "failed"


def test_output_items_and_the_stored_turn_of_a_completion():
    items = output_items({"role": "assistant", "content": None, "reasoning_content": "Hmm",
                          "tool_calls": [CALL]})
    assert [item["type"] for item in items] == ["reasoning", "function_call"]
    [turn] = conversation_turn(items)  # reasoning stays out of the conversation
    assert (turn.role, turn.content, turn.tool_calls[0].id) == ("assistant", None, "call_1")
    [text_turn] = conversation_turn(output_items({"content": "Paris."}))
    assert (text_turn.content, text_turn.tool_calls) == ("Paris.", None)

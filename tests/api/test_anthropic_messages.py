"""The Messages API's pure translations: an Anthropic request to a chat request (and the 400s
on the way), chat chunks to Anthropic's events, and events folded into one message."""

from __future__ import annotations

import json

import msgspec
import pytest

from llmbus.services.api.anthropic_events import MessageStream, message_of
from llmbus.services.api.anthropic_requests import MessagesRequest, chat_request
from llmbus.services.api.bodies import decode_body
from llmbus.services.api.errors import OpenAIError


def _request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}]} | fields
    return decode_body(json.dumps(body).encode(), MessagesRequest)


def _refused(**fields) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        chat_request(_request(**fields))
    assert caught.value.status_code == 400
    return caught.value


TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ROUND_TRIP = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should call the tool", "signature": "s"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "Sunny"}], "is_error": False},
        {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]},
]


def test_a_conversation_with_tools_becomes_chat_messages():
    chat = chat_request(_request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=ROUND_TRIP, tools=TOOLS, metadata={"user_id": "u1"}, service_tier="auto",
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}))
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles == [("system", "Be brief.\n\nBe kind."), ("user", "Weather in Paris?"),
                     ("assistant", "Let me look."), ("tool", "Sunny"), ("user", "Thanks")]
    [call] = chat.messages[2].tool_calls  # the thinking block is not in the prompt
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1", "get_weather", {"city": "Paris"})
    assert chat.messages[3].tool_call_id == "toolu_1"
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": TOOLS[0]["input_schema"]}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.user == "u1"
    assert chat.stream and chat.stream_options.include_usage  # the events need the usage


@pytest.mark.parametrize(("anthropic", "chat"), [("auto", "auto"), ("any", "required"),
                                                 ("none", "none")])
def test_tool_choice(anthropic, chat):
    assert chat_request(_request(tools=TOOLS, tool_choice={"type": anthropic})).tool_choice \
        == chat


def test_sampling_thinking_and_stop_sequences():
    chat = chat_request(_request(temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END"],
                                 thinking={"type": "disabled"}))
    assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (0.5, 0.9, 5, 64)
    assert chat.stop == ["END"] and chat.include_stop_str_in_output
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    enabled = chat_request(_request(thinking={"type": "enabled", "budget_tokens": 32}))
    assert enabled.chat_template_kwargs == {"enable_thinking": True}
    assert chat_request(_request()).chat_template_kwargs is None  # the model's own default


def test_count_tokens_needs_no_max_tokens():
    body = _request()
    body.max_tokens = None
    assert chat_request(body, counting=True).max_tokens is None
    with pytest.raises(OpenAIError, match="max_tokens: Field required"):
        chat_request(body)


@pytest.mark.parametrize(("fields", "message"), [
    ({"messages": []}, "at least one message"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "'toolu_9', which no earlier assistant message has"),
    ({"messages": [*ROUND_TRIP[:1], {"role": "assistant", "content": "The answer is "}]},
     "trailing whitespace"),
    ({"messages": [*ROUND_TRIP[:1], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "a prefill"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "assistant messages"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "greater than"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "only custom tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "needs the tool's `name`"),
])
def test_bad_requests(fields, message):
    assert message in _refused(**fields).message


@pytest.mark.parametrize(("fields", "message"), [
    # unknown: refused by name, never ignored
    ({"top_logprobs": 2}, "unknown field `top_logprobs`"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "Invalid value 'image' - at `$.messages[0].content[0].type`"),
    ({"messages": [{"role": "system", "content": "x"}]},
     "Invalid enum value 'system' - at `$.messages[0].role`"),
])
def test_unknown_fields_and_blocks_are_refused(fields, message):
    with pytest.raises(OpenAIError) as caught:
        _request(**fields)
    assert caught.value.status_code == 400 and message in caught.value.message


# --- chunks to events ------------------------------------------------------------------------

def _chunk(delta: dict, reason: str | None = None) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}


def _usage(num_output_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"id": "c", "choices": [], "usage": {
        "prompt_tokens": 7, "completion_tokens": num_output_tokens,
        "total_tokens": 7 + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}}


def _events(chunks: list[dict], stop_sequences=(), budget=None) -> tuple[list, MessageStream]:
    stream = MessageStream(message_id="msg_1", model="m", num_input_tokens=7,
                           stop_sequences=list(stop_sequences), thinking_budget=budget)
    events = stream.start()
    for num_tokens, chunk in enumerate(chunks):
        events += stream.feed(chunk, num_tokens)
        if stream.done:
            break
    return events + stream.finish(), stream


THINKING_CHUNKS = [_chunk({"role": "assistant", "content": ""}),
                   _chunk({"reasoning_content": "Let me"}),
                   _chunk({"reasoning_content": " think"}),
                   _chunk({"reasoning_content": "", "content": "Paris"}),
                   _chunk({"content": "."}, "stop"), _usage(5, num_cached_tokens=4)]


def test_thinking_then_text_events():
    events, _ = _events(THINKING_CHUNKS)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert all(data["type"] == name for name, data in events)
    starts = [data for name, data in events if name == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [
        (0, "thinking"), (1, "text")]
    assert events[3][1]["delta"] == {"type": "thinking_delta", "thinking": "Let me"}
    assert events[-2][1] == {"type": "message_delta",
                             "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {"input_tokens": 3, "cache_creation_input_tokens": 0,
                                       "cache_read_input_tokens": 4, "output_tokens": 5}}
    assert events[0][1]["message"]["usage"] == {  # before the prompt ran: nothing known cached
        "input_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
        "output_tokens": 0}
    message = message_of(events)
    assert message == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "thinking", "thinking": "Let me think", "signature": ""},
                    {"type": "text", "text": "Paris."}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 3, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 4, "output_tokens": 5}}


def test_a_stop_sequence_is_reported_and_taken_out():
    chunks = [_chunk({"content": "one two"}), _chunk({"content": " END"}, "stop"), _usage(3)]
    message = message_of(_events(chunks, stop_sequences=["STOP", "END"])[0])
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert message["content"] == [{"type": "text", "text": "one two "}]
    natural = message_of(_events([_chunk({"content": "one"}, "stop")], ["END"])[0])
    assert (natural["stop_reason"], natural["stop_sequence"]) == ("end_turn", None)


def test_max_tokens_and_tool_use():
    assert message_of(_events([_chunk({"content": "a"}, "length")])[0])["stop_reason"] \
        == "max_tokens"
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    events, _ = _events([_chunk({"reasoning_content": "hmm"}),
                         _chunk({"tool_calls": [call]}, "tool_calls"), _usage(9)])
    deltas = [d["delta"] for name, d in events if name == "content_block_delta"]
    assert deltas[-1] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    message = message_of(events)
    thinking, tool = message["content"]
    assert tool["type"] == "tool_use" and tool["id"].startswith("toolu_")
    assert (tool["name"], tool["input"]) == ("get_weather", {"city": "Paris"})
    assert message["stop_reason"] == "tool_use"


def test_the_thinking_budget_ends_the_generation():
    """Chunk k comes with k output tokens: a budget of 2 lets the reasoning of chunk 1 and 2
    through, and chunk 3 (3 tokens) ends it with no answer."""
    chunks = [_chunk({"role": "assistant", "content": ""}),
              *[_chunk({"reasoning_content": f"r{k}"}) for k in range(1, 6)],
              _chunk({"content": "late"}, "stop")]
    events, stream = _events(chunks, budget=2)
    assert stream.done
    message = message_of(events)
    assert message["content"] == [{"type": "thinking", "thinking": "r1r2", "signature": ""}]
    assert message["stop_reason"] == "max_tokens"
    unlimited = message_of(_events(chunks, budget=10)[0])
    assert unlimited["content"][1] == {"type": "text", "text": "late"}


def test_a_failure_is_one_error_event():
    events, stream = _events([_chunk({"content": "a"}), {"error": {
        "message": "generation failed: boom", "type": "server_error"}}, _chunk({"content": "b"})])
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "generation failed: boom"}})
    assert stream.failed and not any(name == "message_stop" for name, _ in events)


def test_request_structs_round_trip_the_sdk_shapes():
    """Blocks decode by their `type` tag, as the SDK sends them."""
    req = _request(messages=ROUND_TRIP, tools=TOOLS)
    assert [type(b).__name__ for b in req.messages[1].content] == [
        "ThinkingBlock", "TextBlock", "ToolUseBlock"]
    assert msgspec.json.decode(msgspec.json.encode(req), type=MessagesRequest) == req


def test_a_final_assistant_message_is_continued():
    chat = chat_request(_request(messages=[
        *ROUND_TRIP[:1], {"role": "assistant", "content": "The answer is"}]))
    assert chat.continue_final_message and chat.messages[-1].content == "The answer is"
    assert not chat_request(_request(messages=ROUND_TRIP[:1])).continue_final_message

"""The Responses API as its spec writes it: every field of the Response object, `completed_at`
null until the end, a capped message's item status, `strict` on echoed tools; the routes
beside create (input_tokens, input_items, compact, cancel); and Server-Sent Events whose lines
end with `\\n`, read here by a reader that splits on `\\n` only (as hand-written ones do)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.stack import AUTH, MODEL_NAME

# The Response object's fields in OpenAI's spec (openai-openapi, `Response`).
RESPONSE_FIELDS = {
    "id", "object", "created_at", "status", "completed_at", "background", "error",
    "incomplete_details", "instructions", "max_output_tokens", "max_tool_calls", "model",
    "output", "parallel_tool_calls", "previous_response_id", "conversation", "reasoning",
    "store", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
    "text", "tool_choice", "tools", "truncation", "service_tier", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "usage", "user", "metadata"}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _post(stack, path: str, body: dict, status: int = 200) -> dict:
    response = httpx.post(f"{stack.base_url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def _events(stack, path: str, body: dict) -> list[tuple[str | None, dict | str]]:
    """The stream's events, framed by `\\n` alone; no `\\r` anywhere."""
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True},
                      headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        raw = response.read()
    assert b"\r" not in raw
    events = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        fields = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = fields["data"]
        events.append((fields.get("event"), data if data == "[DONE]" else json.loads(data)))
    return events


def test_a_response_has_every_field_of_the_spec(stack):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, "temperature": 0,
            "tools": [TOOL], "tool_choice": "none", "presence_penalty": 0.5}
    response = _post(stack, "/responses", body)
    assert set(response) == RESPONSE_FIELDS
    assert response["completed_at"] >= response["created_at"]
    assert response["tools"][0]["strict"] is None  # left out, echoed as not enforced
    assert response["presence_penalty"] == 0.5
    events = _events(stack, "/responses", body)
    created, in_progress = events[0][1], events[1][1]
    assert [created["type"], in_progress["type"]] == ["response.created",
                                                      "response.in_progress"]
    for event in (created, in_progress):
        assert set(event["response"]) == RESPONSE_FIELDS
        assert event["response"]["completed_at"] is None
    assert events[-1][1]["response"]["completed_at"] is not None


def test_a_message_cut_by_max_output_tokens_is_incomplete(stack):
    body = {"model": MODEL_NAME, "input": "Tell me a story.", "max_output_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    response = _post(stack, "/responses", body)
    assert response["status"] == "incomplete"
    assert response["output"][-1]["status"] == "incomplete"
    events = _events(stack, "/responses", body)
    done = [e for _, e in events if e["type"] == "response.output_item.done"]
    assert done[-1]["item"]["status"] == "incomplete"
    assert events[-1][1]["type"] == "response.incomplete"


@pytest.mark.parametrize(("path", "body"), [
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ("/completions", {"prompt": "Hi", "max_tokens": 3}),
    ("/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})])
def test_other_streams_split_on_newlines_too(stack, path, body):
    events = _events(stack, path, {"model": MODEL_NAME, **body})
    assert len(events) >= 3
    if path == "/messages":
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    else:
        assert events[-1][1] == "[DONE]"


def test_input_tokens_counts_what_create_would_prefill(stack):
    body = {"model": MODEL_NAME, "instructions": "Be brief.", "input": "What is 2 + 2?"}
    counted = _post(stack, "/responses/input_tokens", body)
    assert counted["object"] == "response.input_tokens"
    made = _post(stack, "/responses", {**body, "max_output_tokens": 2, "store": False})
    assert counted["input_tokens"] == made["usage"]["input_tokens"] > 0


def test_input_items_are_listed_in_pages(stack):
    items = [{"type": "message", "role": "user", "content": f"Note {i}."} for i in range(5)]
    response = _post(stack, "/responses", {"model": MODEL_NAME, "input": items,
                                            "max_output_tokens": 2})
    url = f"{stack.base_url}/responses/{response['id']}/input_items"
    first = httpx.get(url, params={"limit": 2}, headers=AUTH, timeout=30).json()
    assert first["object"] == "list" and first["has_more"] is True
    assert [i["content"][0]["text"] for i in first["data"]] == ["Note 4.", "Note 3."]
    rest = httpx.get(url, params={"after": first["last_id"], "order": "desc"}, headers=AUTH,
                     timeout=30).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Note 2.", "Note 1.", "Note 0."]
    assert rest["has_more"] is False and rest["first_id"] == rest["data"][0]["id"]
    ascending = httpx.get(url, params={"order": "asc"}, headers=AUTH, timeout=30).json()
    assert [i["id"] for i in ascending["data"]] == [i["id"] for i in reversed(
        first["data"] + rest["data"])]
    bad = httpx.get(url, params={"limit": 500}, headers=AUTH, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_compact_keeps_the_user_turns_and_a_summary_that_can_continue(stack):
    first = _post(stack, "/responses", {"model": MODEL_NAME, "input": "My name is Ada.",
                                         "max_output_tokens": 8, "temperature": 0})
    compacted = _post(stack, "/responses/compact", {
        "model": MODEL_NAME, "previous_response_id": first["id"],
        "input": [{"role": "user", "content": "What is my name?"}], "max_output_tokens": 24})
    assert compacted["object"] == "response.compaction"
    *kept, summary = compacted["output"]
    assert [k["content"][0]["text"] for k in kept] == ["What is my name?"]
    assert summary["type"] == "compaction" and summary["encrypted_content"]
    assert compacted["usage"]["output_tokens"] > 0
    again = _post(stack, "/responses", {"model": MODEL_NAME, "input": compacted["output"],
                                         "max_output_tokens": 4})
    assert again["status"] in ("completed", "incomplete")


def test_cancel_and_unknown_paths(stack):
    stored = _post(stack, "/responses", {"model": MODEL_NAME, "input": "Hi",
                                          "max_output_tokens": 2})
    refused = _post(stack, f"/responses/{stored['id']}/cancel", {}, status=400)
    assert "background" in refused["error"]["message"]
    _post(stack, "/responses/resp_nope/cancel", {}, status=404)
    _post(stack, "/responses/resp_nope/no_such_thing", {}, status=404)

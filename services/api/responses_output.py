"""OpenAI's Responses API, outward: a chat completion (or its stream of chunks) as a response
object and its typed events.

The chat path says what was generated: reasoning, text, function calls, a finish reason.
Here that becomes output items (`reasoning`, `message`, `function_call`) and, streamed, the
events in the order the API documents: `response.created`, `response.in_progress`, per item
`response.output_item.added`, its deltas and `...done` events, `response.output_item.done`,
then `response.completed` (or `response.incomplete` when max_output_tokens cut it short;
`error` and `response.failed` when generation failed), each with its `sequence_number`.
Pure: dicts in, dicts out.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmbus.services.api.schemas import ChatMessageIn, FunctionCallIn, ToolCallIn

Event = tuple[str, dict]  # (type, body): the SSE `event:` name and its `data:`


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict) -> dict:
    """Chat's usage in the Responses API's words (reasoning is not counted apart: 0; the
    prefix cache is filled as a side effect, never written on request: 0 written)."""
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant",
            "status": status, "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def output_items(message: dict, finish_reason: str | None = None) -> list[dict]:
    """A chat completion's message as output items: reasoning, then calls or the text (whose
    item is `incomplete` when max_output_tokens cut it short)."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("tool_calls"):
        items += [function_call_item(call) for call in message["tool_calls"]]
    else:
        items.append(message_item(message.get("content") or "",
                                  status=status_of(finish_reason)[0]))
    return items


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished generation."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def conversation_turn(items: list[dict]) -> list[ChatMessageIn]:
    """What a turn's output adds to the stored conversation: the assistant's text or calls
    (its reasoning stays out, as chat templates leave earlier thinking out)."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [ToolCallIn(id=item["call_id"], function=FunctionCallIn(
        name=item["name"], arguments=item["arguments"]))
        for item in items if item["type"] == "function_call"]
    return [ChatMessageIn(role="assistant", content=text or None, tool_calls=calls or None)]


@dataclass
class ResponseEvents:
    """One streamed response: chat chunks in, Responses events out."""

    response: dict  # the response object as it stands (status, output, usage)
    sequence_number: int = 0
    open_item: dict | None = None  # the item whose deltas are streaming
    open_text: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    def _event(self, kind: str, **body: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence_number, **body}
        self.sequence_number += 1
        return kind, event

    def _snapshot(self) -> dict:
        return dict(self.response, output=list(self.response["output"]))

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def chunk(self, chunk: dict) -> list[Event]:
        """The events of one chat chunk (a reasoning or text delta, whole tool calls, the
        finish reason)."""
        events: list[Event] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                events += self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._close() + self._function_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text_delta(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open_item is None or self.open_item["type"] != kind:
            events += self._close() + self._open(kind)
        assert self.open_item is not None
        self.open_text.append(text)
        index, item_id = len(self.response["output"]), self.open_item["id"]
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=item_id, output_index=index, content_index=0,
                                  delta=text, **extra))
        return events

    def _open(self, kind: str) -> list[Event]:
        index = len(self.response["output"])
        if kind == "reasoning":
            self.open_item = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                              "content": [], "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=index,
                                item=self.open_item)]
        self.open_item = dict(message_item("", status="in_progress"), content=[])
        return [self._event("response.output_item.added", output_index=index,
                            item=self.open_item),
                self._event("response.content_part.added", item_id=self.open_item["id"],
                            output_index=index, content_index=0, part=_text_part(""))]

    def _close(self, status: str = "completed") -> list[Event]:
        """End the open reasoning or message item: its `done` events; into the output."""
        item, text = self.open_item, "".join(self.open_text)
        if item is None:
            return []
        self.open_item, self.open_text = None, []
        index, item_id = len(self.response["output"]), item["id"]
        if item["type"] == "reasoning":
            done = reasoning_item(text, item_id)
            events = [self._event("response.reasoning_text.done", item_id=item_id,
                                  output_index=index, content_index=0, text=text)]
        else:
            done = message_item(text, item_id, status)
            events = [self._event("response.output_text.done", item_id=item_id,
                                  output_index=index, content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item_id,
                                  output_index=index, content_index=0, part=_text_part(text))]
        self.response["output"].append(done)
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=done)]

    def _function_call(self, call: dict) -> list[Event]:
        """A whole call (the chat path holds calls until they parse): added, its arguments
        in one delta, done."""
        index, item = len(self.response["output"]), function_call_item(call)
        arguments = item["arguments"]
        events = [self._event("response.output_item.added", output_index=index,
                              item=dict(item, arguments="", status="in_progress")),
                  self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=arguments),
                  self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=arguments, name=item["name"]),
                  self._event("response.output_item.done", output_index=index, item=item)]
        self.response["output"].append(item)
        return events

    def finish(self, chat_usage: dict) -> list[Event]:
        """Close the last item and settle the response's status and usage; `completed()`
        then announces it (after the caller stored it)."""
        status, details = status_of(self.finish_reason)
        events = self._close(status)
        self.response |= {"status": status, "incomplete_details": details,
                          "usage": usage(chat_usage), "completed_at": int(time.time())}
        return events

    def completed(self) -> Event:
        kind = "response.completed" if self.response["status"] == "completed" \
            else "response.incomplete"
        return self._event(kind, response=self._snapshot())

    def fail(self, message: str) -> list[Event]:
        """Generation failed mid-stream: `error`, then the response as failed."""
        self.open_item, self.open_text = None, []
        self.response |= {"status": "failed",
                          "error": {"code": "server_error", "message": message}}
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=self._snapshot())]

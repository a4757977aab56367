"""Chat-completion chunks (`Generation.chunks()`) as Anthropic's Messages stream events, and
those events folded into one message (the non-streamed answer). Pure: dicts in, events out.

    message_start, ping,
      (content_block_start, content_block_delta..., content_block_stop) per block,
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop

Blocks follow the chat deltas: `reasoning_content` makes a `thinking` block, `content` a `text`
block, each tool call (they come whole, at the end) a `tool_use` block with one
`input_json_delta`. A failure (an `{"error": ...}` chunk) is one `error` event, then nothing.

The thinking budget: the chat path has no cap on reasoning alone, so the stream watches the
output's token count while the model is still thinking, and the first delta of reasoning that
takes it past `budget_tokens` is not sent: the generation ends there (the caller closes the
chunks, which aborts the request) with `stop_reason: max_tokens`. The thinking a client sees
thus never spans more than `budget_tokens` output tokens (`<think>` included).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

Event = tuple[str, dict]

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "abort": "end_turn"}
_EMPTY = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
          "text": {"type": "text", "text": ""}}
_DELTA_FIELD = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class MessageStream:
    """One message's events, fed the chat chunks in order with the output's token count."""

    def __init__(self, *, message_id: str, model: str, num_input_tokens: int,
                 stop_sequences: list[str], thinking_budget: int | None) -> None:
        self.message_id = message_id
        self.model = model
        self.num_input_tokens = num_input_tokens
        self.stop_sequences = stop_sequences
        self.thinking_budget = thinking_budget
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # of the input, read from the prefix cache
        self.num_blocks = 0
        self.open: str | None = None  # the kind of the block still open
        self.answered = False  # text or a tool call began: thinking is over
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.done = False  # no more chunks wanted
        self.failed = False

    def start(self) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": self._usage()}}),
            ("ping", {"type": "ping"})]

    def feed(self, chunk: dict, num_output_tokens: int) -> list[Event]:
        """The events of one chat chunk; `num_output_tokens`: the tokens generated so far."""
        if "error" in chunk:
            self.done = self.failed = True
            return [("error", {"type": "error", "error": {
                "type": "api_error", "message": chunk["error"]["message"]}})]
        self.num_output_tokens = max(self.num_output_tokens, num_output_tokens)
        if chunk.get("usage"):
            self.num_output_tokens = chunk["usage"]["completion_tokens"]
            self.num_cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        if not chunk["choices"]:
            return []
        [choice] = chunk["choices"]
        delta, reason = choice["delta"], choice["finish_reason"]
        reasoning, content = delta.get("reasoning_content") or "", delta.get("content") or ""
        if reason == "stop":
            reasoning, content = self._strip_stop(reasoning, content)
        if (reasoning and not self.answered and self.thinking_budget is not None
                and self.num_output_tokens > self.thinking_budget):
            self.done, self.stop_reason = True, "max_tokens"
            return []
        events = self._text("thinking", reasoning) + self._text("text", content)
        for call in delta.get("tool_calls") or []:
            events += self._tool_use(call["function"])
        if reason:
            self.stop_reason = self.stop_reason or STOP_REASONS[reason]
        return events

    def finish(self) -> list[Event]:
        """The events that end the message (none after an error event)."""
        if self.failed:
            return []
        return [*self._close(), ("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason or "end_turn",
                      "stop_sequence": self.stop_sequence},
            "usage": self._usage()}),
            ("message_stop", {"type": "message_stop"})]

    def _usage(self) -> dict:
        """Anthropic's usage: `input_tokens` are those computed, apart from those read from
        the cache (the prefix cache; it fills itself, so nothing is written on request); the
        counts of the cache are known once the prompt ran, so `message_delta` has them."""
        return {"input_tokens": self.num_input_tokens - self.num_cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": self.num_cached_tokens,
                "output_tokens": self.num_output_tokens}

    def _strip_stop(self, reasoning: str, content: str) -> tuple[str, str]:
        """A stop string ended the output (it is asked into the text, see chat_request):
        `stop_sequence`, and the string taken out; at a plain end of turn none is there."""
        for stop in self.stop_sequences:
            if content.endswith(stop):
                self.stop_reason, self.stop_sequence = "stop_sequence", stop
                return reasoning, content[:-len(stop)]
            if not content and reasoning.endswith(stop):
                self.stop_reason, self.stop_sequence = "stop_sequence", stop
                return reasoning[:-len(stop)], content
        return reasoning, content

    def _text(self, kind: str, text: str) -> list[Event]:
        if not text:
            return []
        events = []
        if self.open != kind:
            events = self._close() + self._open(kind, dict(_EMPTY[kind]))
        self.answered = self.answered or kind == "text"
        delta_type, field = _DELTA_FIELD[kind]
        return [*events, ("content_block_delta", {
            "type": "content_block_delta", "index": self.num_blocks - 1,
            "delta": {"type": delta_type, field: text}})]

    def _tool_use(self, function: dict) -> list[Event]:
        self.answered = True
        events = self._close() + self._open("tool_use", {
            "type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
            "name": function["name"], "input": {}})
        events.append(("content_block_delta", {
            "type": "content_block_delta", "index": self.num_blocks - 1,
            "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))
        return events + self._close()

    def _open(self, kind: str, block: dict) -> list[Event]:
        self.open = kind
        self.num_blocks += 1
        return [("content_block_start", {"type": "content_block_start",
                                         "index": self.num_blocks - 1, "content_block": block})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": self.num_blocks - 1})]


def message_of(events: list[Event]) -> dict:
    """The message that a complete event stream describes (as the SDK's accumulator builds
    it): the non-streamed answer."""
    message: dict[str, Any] = {}
    partial_json: dict[int, str] = {}
    for name, data in events:
        if name == "message_start":
            message = {**data["message"], "content": [],
                       "usage": dict(data["message"]["usage"])}
        elif name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial_json[data["index"]] = (partial_json.get(data["index"], "")
                                               + delta["partial_json"])
            else:
                field = "thinking" if delta["type"] == "thinking_delta" else "text"
                block[field] += delta[field]
        elif name == "content_block_stop" and data["index"] in partial_json:
            block = message["content"][data["index"]]
            block["input"] = json.loads(partial_json[data["index"]] or "{}")
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    return message

"""Anthropic's Messages request (msgspec structs) and its translation to a chat request:
pure, so the HTTP routes (anthropic_messages.py) only admit what this returns.

Fields this server implements are translated; the harmless ones that change nothing here are
accepted (`metadata.user_id`, `service_tier`, `cache_control` on blocks and tools: the prefix
cache is automatic; `citations` on text blocks); any other field or block type is a 400 naming
it, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from llmbus.services.api.bodies import Int
from llmbus.services.api.errors import bad_request
from llmbus.services.api.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    FunctionCallIn,
    StreamOptions,
    ToolCallIn,
)


class _Block(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


class TextBlock(_Block, tag="text"):
    text: str
    cache_control: Any = None
    citations: Any = None


class ToolUseBlock(_Block, tag="tool_use"):
    id: str
    name: str
    input: Any
    cache_control: Any = None


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # accepted; the content itself tells the model what went wrong
    cache_control: Any = None


class ThinkingBlock(_Block, tag="thinking"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class MessageIn(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str = ""
    type: str = "custom"
    cache_control: Any = None


class ToolChoiceIn(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingIn(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["enabled", "disabled"]
    budget_tokens: Int | None = None


class MetadataIn(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[MessageIn]
    max_tokens: Int | None = None  # required by /v1/messages, not by count_tokens
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    stream: bool = False
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    metadata: MetadataIn | None = None
    service_tier: str | None = None  # one tier here: any value is honoured trivially
    ignore_eos: bool = False  # vLLM's extension, as on chat (benchmarks fix output lengths)


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "\n\n".join(b.text for b in blocks)


def _assistant(blocks: list[Block], tool_use_ids: set[str]) -> ChatMessageIn:
    """An assistant turn: its text and its tool calls; its thinking is not shown again."""
    texts, calls = [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            tool_use_ids.add(block.id)
            calls.append(ToolCallIn(id=block.id, function=FunctionCallIn(
                name=block.name, arguments=json.dumps(block.input))))
        elif isinstance(block, ToolResultBlock):
            raise bad_request("`tool_result` blocks belong in user messages", param="messages")
    return ChatMessageIn(role="assistant", content="\n\n".join(texts),
                         tool_calls=calls or None)


def _user(blocks: list[Block], tool_use_ids: set[str]) -> list[ChatMessageIn]:
    """A user turn: a `tool` message per tool_result (first, as Anthropic orders them), then
    its text."""
    out, texts = [], []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in tool_use_ids:
                raise bad_request(f"`tool_result` block refers to tool_use id "
                                  f"{block.tool_use_id!r}, which no earlier assistant message "
                                  "has as a `tool_use` block", param="messages")
            out.append(ChatMessageIn(role="tool", content=_text(block.content),
                                     tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            raise bad_request("`tool_use` blocks belong in assistant messages", param="messages")
    if texts or not out:
        out.append(ChatMessageIn(role="user", content="\n\n".join(texts)))
    return out


def _messages(req: MessagesRequest) -> list[ChatMessageIn]:
    if not req.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    out = [ChatMessageIn(role="system", content=_text(req.system))] if req.system else []
    tool_use_ids: set[str] = set()
    for message in req.messages:
        content = message.content
        blocks: list[Block] = [TextBlock(content)] if isinstance(content, str) else content
        if message.role == "assistant":
            out.append(_assistant(blocks, tool_use_ids))
        else:
            out.extend(_user(blocks, tool_use_ids))
    return out


def _prefill(messages: list[ChatMessageIn]) -> bool:
    """Whether the answer continues a final assistant message (Anthropic's prefill): its
    text must not end in whitespace (as Anthropic's API says), and a tool call cannot be
    continued."""
    final = messages[-1]
    if final.role != "assistant":
        return False
    text = final.content if isinstance(final.content, str) else ""
    if final.tool_calls or not text:
        raise bad_request("a final assistant message (a prefill) must hold text, not only "
                          "tool_use blocks", param="messages")
    if text != text.rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace",
                          param="messages")
    return True


def _tools(req: MessagesRequest) -> tuple[list[dict] | None, Any, bool | None]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of the chat request."""
    tools = None
    if req.tools is not None:
        tools = []
        for tool in req.tools:
            if tool.type != "custom" or tool.input_schema is None:
                raise bad_request(f"tool {tool.name!r}: only custom tools with an "
                                  f"`input_schema` are supported (got type {tool.type!r})",
                                  param="tools")
            tools.append({"type": "function", "function": {
                "name": tool.name, "description": tool.description,
                "parameters": tool.input_schema}})
    choice = req.tool_choice
    if choice is None:
        return tools, None, None
    if choice.type == "tool" and not choice.name:
        raise bad_request('tool_choice: `{"type": "tool"}` needs the tool\'s `name`',
                          param="tool_choice")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
        "type": "function", "function": {"name": choice.name}}
    return tools, mapped, False if choice.disable_parallel_tool_use else None


def thinking_budget(req: MessagesRequest) -> int | None:
    """The cap on the thinking block's tokens (None: no cap); a 400 if it is not one."""
    thinking = req.thinking
    if thinking is None or thinking.type == "disabled":
        return None
    budget = thinking.budget_tokens
    if budget is None or budget < 1:
        raise bad_request("thinking.budget_tokens: a positive number is required with "
                          '`{"type": "enabled"}`', param="thinking")
    if req.max_tokens is not None and budget >= req.max_tokens:
        raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`",
                          param="max_tokens")
    return budget


def chat_request(req: MessagesRequest, *, counting: bool = False) -> ChatCompletionRequest:
    """The chat request that generates this Messages request's answer (or, `counting`, whose
    prompt count_tokens measures: `max_tokens` may be left out there)."""
    if req.max_tokens is None and not counting:
        raise bad_request("max_tokens: Field required", param="max_tokens")
    thinking_budget(req)
    tools, tool_choice, parallel = _tools(req)
    kwargs = None if req.thinking is None else {"enable_thinking": req.thinking.type == "enabled"}
    stop = list(req.stop_sequences or [])
    messages = _messages(req)
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_tokens=req.max_tokens, stop=stop,
        continue_final_message=_prefill(messages),
        # with the stop string in the text, the end can tell `stop_sequence` from `end_turn`
        include_stop_str_in_output=bool(stop),
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel,
        chat_template_kwargs=kwargs, user=req.metadata.user_id if req.metadata else None,
        ignore_eos=req.ignore_eos, stream=True, stream_options=StreamOptions(include_usage=True))

"""OpenAI's Responses API, inward: a `/v1/responses` body translated into the chat request that
the one generation path serves (services/api/chat.py), and the stored conversation it continues.

Pure: body in, `ChatCompletionRequest` out. What the Responses API has and chat does not
(built-in tools, images, background runs) is refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmbus.services.api.bodies import Int
from llmbus.services.api.errors import bad_request
from llmbus.services.api.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    FunctionCallIn,
    ToolCallIn,
)

MAX_METADATA_KEYS = 16  # as OpenAI: 16 pairs, keys up to 64 characters, values up to 512
_ROLES = {"user", "assistant", "system", "developer"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
# How a compaction item's summary opens when it stands in for the turns it summarises.
COMPACTED = "A summary of our conversation so far:\n\n"


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tool_calls: Int | None = None  # 0: no calls; 1: one at a time; more: a turn's calls
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension, as on chat (benchmarks fix output lengths)
    # Harmless to accept: the prefix cache needs no key, there is one service tier, and no
    # stream is obfuscated.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # Accepted so that asking for them gets a clear answer (see `_refuse_unsupported`).
    include: list[str] | None = None
    background: bool | None = None
    truncation: str | None = None
    top_logprobs: Int | None = None
    conversation: Any = None
    prompt: Any = None


def _refuse_unsupported(req: ResponsesRequest) -> None:
    unsupported = {
        "include": bool(req.include), "background": bool(req.background),
        "truncation": req.truncation not in (None, "disabled"),
        "top_logprobs": req.top_logprobs not in (None, 0),
        "conversation": req.conversation is not None, "prompt": req.prompt is not None}
    for param, used in unsupported.items():
        if used:
            raise bad_request(f"`{param}` is not supported by this server's Responses API",
                              param=param, code="unsupported_parameter")
    if req.max_tool_calls is not None and req.max_tool_calls < 0:
        raise bad_request("`max_tool_calls` must be at least 0", param="max_tool_calls")
    if req.metadata is not None and len(req.metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"`metadata` may hold at most {MAX_METADATA_KEYS} pairs",
                          param="metadata")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: `content` must be a string or a list of parts",
                          param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: only text content parts are supported, got "
                              f"{kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[Any]) -> list[ChatMessageIn]:
    """A request's `input` as chat messages: consecutive function calls become one assistant
    turn with several tool calls; reasoning items of earlier turns are left out of the
    prompt (chat templates drop earlier thinking too)."""
    if isinstance(items, str):
        if not items:
            raise bad_request("`input` must not be empty", param="input")
        return [ChatMessageIn(role="user", content=items)]
    if not items:
        raise bad_request("`input` must not be empty", param="input")
    messages: list[ChatMessageIn] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "function_call":
            call = ToolCallIn(id=_field(item, "call_id", where), function=FunctionCallIn(
                name=_field(item, "name", where), arguments=item.get("arguments") or "{}"))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessageIn(role="assistant", tool_calls=[call]))
        elif kind != "reasoning":
            messages.append(_message_of(item, kind, where))
    return messages


def _message_of(item: dict, kind: str, where: str) -> ChatMessageIn:
    """The chat message of a message, function_call_output or compaction item."""
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}: unknown role {role!r}", param="input")
        return ChatMessageIn(role=role, content=_text(item.get("content"), where))
    if kind == "function_call_output":
        output = item.get("output")
        return ChatMessageIn(role="tool", tool_call_id=_field(item, "call_id", where),
                             content=output if isinstance(output, str) else _text(output, where))
    if kind == "compaction":  # what /v1/responses/compact made: its summary, as text
        return ChatMessageIn(role="user",
                             content=COMPACTED + _field(item, "encrypted_content", where))
    raise bad_request(f"{where}: input items of type {kind!r} are not supported",
                      param="input")


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}: `{name}` is required", param="input")
    return value


def check_tool_results(messages: list[ChatMessageIn]) -> None:
    """Every function_call_output answers a function_call made before it."""
    called: set[str] = set()
    for message in messages:
        called.update(c.id for c in message.tool_calls or [] if c.id)
        if message.role == "tool" and message.tool_call_id not in called:
            raise bad_request(f"no function_call with call_id {message.tool_call_id!r} comes "
                              "before its function_call_output", param="input")


def _tools(tools: list[Any] | None) -> list[dict] | None:
    """Responses' flat function tools as chat's nested ones."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_request(f"tools[{i}]: only function tools are supported, got {kind!r}",
                              param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if req.max_tool_calls == 0:
        return "none"
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> Any:
    """`text.format` as chat's `response_format` (json_schema fields one level up there)."""
    form = (text or {}).get("format")
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return None
    if form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: form[k] for k in ("name", "schema", "strict", "description") if k in form}}
    return form


def _template_kwargs(reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
    """`reasoning.effort: none` turns thinking off (Qwen3's `enable_thinking`); other efforts
    leave the model's default, since a template has no finer control."""
    if reasoning and reasoning.get("effort") == "none":
        return {"enable_thinking": False}
    return None


def chat_request(req: ResponsesRequest, history: list[ChatMessageIn],
                 ) -> tuple[ChatCompletionRequest, list[ChatMessageIn]]:
    """The chat request one Responses turn is (instructions, the stored conversation it
    continues, its input), and the conversation so far without the instructions (which the
    next turn does not inherit, as in OpenAI's API)."""
    _refuse_unsupported(req)
    conversation = history + input_messages(req.input)
    check_tool_results(conversation)
    system = [ChatMessageIn(role="system", content=req.instructions)] if req.instructions \
        else []
    return ChatCompletionRequest(
        model=req.model, messages=system + conversation, stream=False,
        max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        tools=_tools(req.tools), tool_choice=_tool_choice(req) if req.tools else None,
        parallel_tool_calls=False if req.max_tool_calls == 1 else req.parallel_tool_calls,
        response_format=_response_format(req.text),
        user=req.user, ignore_eos=req.ignore_eos,
        chat_template_kwargs=_template_kwargs(req.reasoning)), conversation


def message_dicts(messages: list[ChatMessageIn]) -> list[dict]:
    """Chat messages as JSON-ready dicts (what a stored conversation holds)."""
    return [msgspec.to_builtins(m) for m in messages]

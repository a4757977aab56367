"""HTTP request bodies of the OpenAI API, decoded and validated with msgspec.

Decoding errors become a 400 naming the parameter. Parameters that this server does not
implement are rejected, never silently ignored. Extensions follow vLLM's names (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from llmbus.bus.messages import ChatMessage, SamplingParams
from llmbus.services.api.bodies import MAX_TOKEN_ID, Int, TokenId, prompt_items
from llmbus.services.api.errors import bad_request

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS = 1024


class TextPart(msgspec.Struct):
    type: str
    text: str = ""


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct):
    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    user: str | None = None
    # Output constraints, checked by services/api/constraints.py.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    tools: Any = None  # chat only
    tool_choice: Any = None
    # Accepted so that their presence can be answered clearly (see _reject_unsupported).
    functions: Any = None
    function_call: Any = None
    best_of: Int | None = None
    suffix: str | None = None
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    parallel_tool_calls: bool | None = None  # default: several calls may come at once
    # Extra variables for the chat template (vLLM's extension), e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # The answer continues the final assistant message (vLLM's extension; Messages' prefill).
    continue_final_message: bool = False


class CompletionRequest(_Common, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec unions allow one array type, so
    # the list forms are checked by `completion_prompts`.
    prompt: str | list[Any]
    logprobs: Int | None = None
    echo: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def template_kwargs_json(kwargs: dict[str, Any] | None) -> str:
    """`chat_template_kwargs` for the tokenizer stage, as JSON text ("" when unset)."""
    return msgspec.json.encode(kwargs).decode() if kwargs else ""


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


@dataclass(frozen=True)
class Limits:
    """Server-side caps on what one request may ask for."""

    max_tokens: int = 8192
    max_n: int = 16
    max_prompts: int = 64  # prompts in one batched completion request


_ROLES = {"system", "user", "assistant", "developer", "tool"}


def _reject_unsupported(req: _Common) -> None:
    """Parameters whose meaning this server does not implement."""
    unsupported = {
        "functions": req.functions is not None, "function_call": req.function_call is not None,
        "best_of": req.best_of not in (None, 1, req.n), "suffix": req.suffix is not None,
        "audio": req.audio is not None, "web_search_options": req.web_search_options is not None,
        "modalities": bool(set(req.modalities or []) - {"text"}),
    }
    if not isinstance(req, ChatCompletionRequest):
        unsupported |= {"tools": req.tools is not None, "tool_choice": req.tool_choice is not None}
    for param, used in unsupported.items():
        if used:
            hint = {"functions": "; use `tools`", "function_call": "; use `tool_choice`",
                    "modalities": " (text is the one output here)",
                    "web_search_options": ": it searches nothing",
                    "tools": " on /v1/completions; use /v1/chat/completions",
                    "tool_choice": " on /v1/completions; use /v1/chat/completions"}
            raise bad_request(f"`{param}` is not supported by this server{hint.get(param, '')}",
                              param=param, code="unsupported_parameter")


def _check_range(value: float | None, param: str, low: float, high: float,
                 low_open: bool = False) -> None:
    if value is None:
        return
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise bad_request(f"`{param}` must be in {bracket}{low}, {high}], got {value}",
                          param=param)


def sampling_params(req: _Common, *, max_tokens: int | None, default_max_tokens: int,
                    num_logprobs: int | None, limits: Limits) -> SamplingParams:
    _reject_unsupported(req)
    if not 1 <= req.n <= limits.max_n:
        raise bad_request(f"`n` must be between 1 and {limits.max_n}, got {req.n}", param="n")
    _check_range(req.temperature, "temperature", 0.0, 2.0)
    _check_range(req.top_p, "top_p", 0.0, 1.0)
    _check_range(req.min_p, "min_p", 0.0, 1.0)
    _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(req.repetition_penalty, "repetition_penalty", 0.0, 2.0, low_open=True)
    top_k = req.top_k or 0
    if top_k < -1:
        raise bad_request(f"`top_k` must be -1 or 0 (off) or positive, got {top_k}",
                          param="top_k")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"`max_tokens` must be at least 1, got {max_tokens}",
                          param="max_tokens")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise bad_request(f"`max_tokens` is capped at {limits.max_tokens} by this server, got "
                          f"{max_tokens}", param="max_tokens")
    if req.min_tokens < 0 or (max_tokens is not None and req.min_tokens > max_tokens):
        raise bad_request("`min_tokens` must be between 0 and max_tokens", param="min_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop strings must not be empty", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed",
                          param="stop")
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}",
                          param="top_logprobs" if isinstance(req, ChatCompletionRequest)
                          else "logprobs")
    # `top_p: 0` keeps only the likeliest token: greedy, as vLLM and llama.cpp take it.
    greedy = req.top_p == 0.0
    return SamplingParams(
        temperature=0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if greedy or req.top_p is None else req.top_p, top_k=max(top_k, 0),
        min_p=req.min_p or 0.0,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        seed=req.seed, ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
        stop=stop, include_stop_str_in_output=req.include_stop_str_in_output,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0, min_tokens=req.min_tokens,
        logprobs=num_logprobs, logit_bias=_logit_bias(req.logit_bias))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} entries",
                          param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise bad_request(f"`logit_bias` keys must be token ids, got {key!r}",
                              param="logit_bias")
        _check_range(value, "logit_bias", -100.0, 100.0)
        out[int(key)] = float(value)
    return out


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def completion_prompts(req: CompletionRequest, limits: Limits) -> list[str | list[int]]:
    """The prompts of a completion request, each as text or token ids."""
    return prompt_items(req.prompt, "prompt", limits.max_prompts)


def chat_messages(messages_in: list[ChatMessageIn] | None) -> list[ChatMessage]:
    if not messages_in:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    messages = []
    for message in messages_in:
        if message.role not in _ROLES:
            raise bad_request(f"unknown message role {message.role!r}", param="messages")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise bad_request("only text content parts are supported", param="messages")
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        if role == "tool" and not message.tool_call_id:
            raise bad_request("a `tool` message needs the `tool_call_id` it answers",
                              param="messages")
        calls = ""
        if message.tool_calls:
            if role != "assistant":
                raise bad_request("only assistant messages carry `tool_calls`", param="messages")
            calls = msgspec.json.encode([{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}}
                for c in message.tool_calls]).decode()
        messages.append(ChatMessage(role=role, content=content or "", tool_calls_json=calls,
                                    tool_call_id=message.tool_call_id or ""))
    return messages

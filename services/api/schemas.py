"""HTTP request bodies of the OpenAI API, decoded and validated with msgspec.

Decoding errors become a 400 naming the parameter. Parameters that this server does not
implement are rejected, never silently ignored.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from bus.messages import ChatMessage, SamplingParams
from services.api.errors import bad_request


class TextPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    user: str | None = None
    # Accepted so their presence can be answered clearly (see UNSUPPORTED).
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None
    logit_bias: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None


class CompletionRequest(_Common, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec unions allow one array type, so
    # the list forms are checked by `completion_prompt`.
    prompt: str | list[Any]


_ROLES = {"system", "user", "assistant", "developer"}


def decode_body(body: bytes, request_type: type) -> Any:
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = (re.search(r"at `\$\.([A-Za-z_]+)", message)
                 or re.search(r"missing required field `([A-Za-z_]+)`", message))
        raise bad_request(f"invalid request: {message}",
                          param=match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _reject_unsupported(req: _Common) -> None:
    """Parameters whose meaning this server does not implement yet."""
    unsupported = {
        "tools": req.tools is not None, "tool_choice": req.tool_choice is not None,
        "functions": req.functions is not None,
        "response_format": req.response_format not in (None, {"type": "text"}),
        "logprobs": req.logprobs not in (None, False, 0),
        "top_logprobs": req.top_logprobs not in (None, 0),
        "logit_bias": bool(req.logit_bias),
        "presence_penalty": req.presence_penalty not in (None, 0.0),
        "frequency_penalty": req.frequency_penalty not in (None, 0.0),
        "echo": req.echo, "best_of": req.best_of not in (None, 1),
        "suffix": req.suffix is not None,
    }
    for param, used in unsupported.items():
        if used:
            raise bad_request(f"`{param}` is not supported by this server", param=param,
                              code="unsupported_parameter")


def sampling_params(req: _Common, max_tokens: int | None, default_max_tokens: int,
                    max_tokens_cap: int) -> SamplingParams:
    _reject_unsupported(req)
    if req.n != 1:
        raise bad_request("only n=1 is supported by this server", param="n")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be between 0 and 2, got {temperature}",
                          param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = req.top_k or 0
    if top_k < 0 and top_k != -1:
        raise bad_request(f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens is not None and max_tokens > max_tokens_cap:
        raise bad_request(f"max_tokens is capped at {max_tokens_cap} by this server, got "
                          f"{max_tokens}", param="max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop strings must not be empty", param="stop")
    if len(stop) > 16:
        raise bad_request("at most 16 stop strings are allowed", param="stop")
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        seed=req.seed, ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
        stop=stop, include_stop_str_in_output=req.include_stop_str_in_output)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request, as text or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("batched prompts are not supported yet; send one prompt",
                              param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list) and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad_request("`prompt` must be a string, a list of strings, a list of token ids "
                          "or a list of token-id lists", param="prompt")
    if not prompt:
        raise bad_request("`prompt` must not be empty", param="prompt")
    return prompt


def chat_messages(req: ChatCompletionRequest) -> list[ChatMessage]:
    if not req.messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    messages = []
    for message in req.messages:
        if message.role not in _ROLES:
            raise bad_request(f"unknown message role {message.role!r}", param="messages")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise bad_request("only text content parts are supported", param="messages")
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        messages.append(ChatMessage(role=role, content=content or ""))
    return messages

"""Response and stream-chunk bodies in the OpenAI wire format."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from llmbus.bus.messages import FinishReason, TextLogprob
from llmbus.services.api.reasoning import split_reasoning
from llmbus.services.tool_calls import Call

if TYPE_CHECKING:  # the request in flight whose choices these bodies render
    from llmbus.services.api.generation import Choice, Generation

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}
_MIN_LOGPROB = -9999.0  # JSON has no -inf


def finish_reason_name(reason: int) -> str | None:
    return FINISH_REASONS.get(FinishReason(reason))


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def chat_logprobs(items: list[TextLogprob]) -> dict:
    """`choices[i].logprobs` of a chat completion (or chunk); this server never refuses in
    words, so `refusal` is always null."""
    return {"refusal": None, "content": [{
        "token": item.token, "logprob": _lp(item.logprob), "bytes": list(item.token_bytes),
        "top_logprobs": [{"token": token, "logprob": _lp(lp), "bytes": list(raw)}
                         for token, lp, raw in zip(item.top_tokens, item.top_logprobs,
                                                   item.top_token_bytes, strict=False)],
    } for item in items]}


def completion_logprobs(items: list[TextLogprob], text_offset: int) -> dict:
    """`choices[i].logprobs` of a text completion: parallel lists, offsets into the text."""
    offsets = []
    for item in items:
        offsets.append(text_offset)
        text_offset += len(item.token)
    return {"tokens": [item.token for item in items],
            "token_logprobs": [_lp(item.logprob) for item in items],
            "top_logprobs": [dict(zip(item.top_tokens, map(_lp, item.top_logprobs),
                                      strict=False)) for item in items],
            "text_offset": offsets}


def completion_object(chat: bool, stream: bool) -> str:
    if chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def tool_calls(calls: list[Call], stream: bool) -> list[dict]:
    """`message.tool_calls` (or, streamed, `delta.tool_calls`, which carry their index)."""
    return [{**({"index": i} if stream else {}), "id": f"call_{uuid.uuid4().hex[:24]}",
             "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def collected_choice(gen: Generation, index: int, choice: Choice) -> dict:
    """`choices[index]` of a non-streamed answer: the text (echo first), or a chat message
    with its reasoning apart and its function calls parsed."""
    echo = gen.echo_texts[index // gen.n]
    text = echo + "".join(choice.text)
    reason = finish_reason_name(choice.finish_reason)
    if not gen.chat:
        return {"index": index, "text": text, "logprobs": completion_logprobs(
            choice.logprobs, len(echo)) if gen.with_logprobs else None, "finish_reason": reason}
    reasoning, text = (split_reasoning(text, gen.reasoning_open) if gen.reasoning
                       else (None, text))
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    calls = gen._calls(choice, text)  # in the answer, not the reasoning
    if calls:
        message = {"role": "assistant", "content": None, "refusal": None,
                   "tool_calls": tool_calls(calls, stream=False)}
        reason = "tool_calls"
    if gen.reasoning:
        message["reasoning_content"] = reasoning
    return {"index": index, "message": message, "finish_reason": reason,
            "logprobs": chat_logprobs(choice.logprobs) if gen.with_logprobs else None}

"""Response and stream-chunk bodies in the OpenAI wire format."""

from __future__ import annotations

from bus.messages import FinishReason

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}


def finish_reason_name(reason: int) -> str | None:
    return FINISH_REASONS.get(FinishReason(reason))


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def chat_completion(request_id: str, created: int, model: str, text: str, finish_reason: str,
                    usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_}


def chat_chunk(request_id: str, created: int, model: str, delta: dict,
               finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]}


def text_completion(request_id: str, created: int, model: str, text: str, finish_reason: str,
                    usage_: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_}


def text_chunk(request_id: str, created: int, model: str, text: str,
               finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, created: int, model: str, obj: str, usage_: dict) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_}

"""What the scheduler tells the detokenizer about a request: its new tokens, and whether and why
it ended; and what it tells the api of an embedding request (no detokenizer is involved).
Pure functions of a request's state."""

from __future__ import annotations

from collections.abc import Sequence

from llmbus.bus.messages import CompletionStart, FinishReason, RequestTokens, TextDelta
from llmbus.services.scheduler.request import Embedded, Request


def stop_reason(request: Request, token_id: int, eos_token_ids: Sequence[int]) -> FinishReason:
    """Why the request ends with `token_id` just appended (NONE: it goes on)."""
    params = request.params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:  # the sampler suppresses them before that
        if not params.ignore_eos and token_id in eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
    if num_output >= request.max_tokens:
        return FinishReason.LENGTH
    return FinishReason.NONE


def token_update(request: Request, step_id: int, error: str = "",
                 index: int | None = None, resumable: bool = False) -> RequestTokens:
    """The tokens not sent yet (marks them sent). The first update of a completion also
    carries its start (the constants a detokenizer copy needs; the routing sends it again when
    the completion moves to another copy) and the request's queue time. A resumed request's
    start replays the tokens it streamed before it moved here."""
    sent = request.sent
    first = not sent.start
    num_before = sent.num_tokens
    new_token_ids = request.output_token_ids[num_before:]
    new_logprobs, sent.logprobs = sent.logprobs, []
    sent.num_tokens = len(request.output_token_ids)
    sent.start = True
    queued = ((request.trace.first_scheduled_time or request.trace.arrival_time)
              - request.trace.arrival_time if first else 0.0)
    return RequestTokens(
        request_id=request.request_id, index=request.index if index is None else index,
        new_token_ids=new_token_ids, finish_reason=request.finish_reason, error=error,
        step_id=step_id, logprobs=new_logprobs, queue_seconds=max(queued, 0.0),
        start=completion_start(request, request.output_token_ids[:num_before])
        if first else None,
        attempt=request.attempt, num_before=num_before, resumable=resumable)


def completion_start(request: Request, replay_token_ids: list[int]) -> CompletionStart:
    return CompletionStart(
        reply_subject=request.reply_subject, num_prompt_tokens=request.num_prompt_tokens,
        stop=request.params.stop,
        include_stop_str_in_output=request.params.include_stop_str_in_output,
        traceparent=request.trace.traceparent, replay_token_ids=replay_token_ids,
        num_cached_tokens=request.trace.num_cached_tokens)


def end_updates(request: Request, step_id: int, error: str = "",
                resumable: bool = False) -> list[RequestTokens]:
    """The final update(s) of an ended request: a parent ends all n completions. `resumable`:
    the error is the pipeline's, and the request's owner may resume it on another engine."""
    if not request.is_parent:
        return [token_update(request, step_id, error, resumable=resumable)]
    updates, started = [], request.sent.start
    for i in range(request.num_forks):  # none of the n has had its start: each gets it
        request.sent.start = started
        updates.append(token_update(request, step_id, error, index=i, resumable=resumable))
    return updates


def embedding_answer(ended: Embedded) -> TextDelta:
    """An ended embedding request's answer to its api copy: the vector, or the error."""
    request = ended.request
    return TextDelta(
        request_id=request.request_id, text="", index=request.index, attempt=request.attempt,
        finish_reason=FinishReason.STOP if ended.vector else FinishReason.ERROR,
        num_prompt_tokens=request.num_prompt_tokens, error=ended.error,
        embedding=ended.vector, resumable=bool(ended.error) and ended.error != "aborted")

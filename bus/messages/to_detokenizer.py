"""Received by the detokenizer (from the scheduler)."""

from __future__ import annotations

from llmbus.bus.messages.common import FinishReason, Message, TokenLogprobs


class RequestTokens(Message):
    request_id: str
    reply_subject: str
    new_token_ids: list[int]
    finish_reason: FinishReason = FinishReason.NONE
    num_prompt_tokens: int = 0
    # Sent with the first tokens of a request so the detokenizer can set up its state.
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    error: str = ""
    step_id: int = 0
    index: int = 0  # which of the request's n completions
    logprobs: list[TokenLogprobs] = []  # parallel to new_token_ids, when asked for
    # With a request's first update: its trace context (a batch has many requests, so the
    # message header cannot carry it) and how long it waited before its first step.
    traceparent: str = ""
    queue_seconds: float = 0.0
    # When a completion moves to another detokenizer copy (its copy died): the tokens the old
    # copy already had. The new copy decodes them first without sending their text, which
    # restores what the old one held back for a stop string, then goes on with new_token_ids.
    replay_token_ids: list[int] = []


class TokenBatch(Message):
    """All token updates of one engine step (one message per step, not per token)."""

    engine_id: str
    items: list[RequestTokens]

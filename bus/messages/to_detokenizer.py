"""Received by the detokenizer (from the scheduler)."""

from __future__ import annotations

from llmbus.bus.messages.common import FinishReason, Message, TokenLogprobs


class CompletionStart(Message):
    """What a detokenizer copy must know of a completion before it decodes its tokens: its
    constants, sent once per completion per copy, with the first tokens that copy gets of it
    (the completion's first tokens, or the first after it moved there). A copy that gets a
    `start` sets the completion up afresh, whatever it held of it before."""

    reply_subject: str  # the api copy that owns the request
    num_prompt_tokens: int = 0
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    # The request's trace context (a batch has many requests, so the message header cannot
    # carry it): the copy's span joins the request's trace.
    traceparent: str = ""
    # When the completion moves from a copy that died: the tokens the old copy already had.
    # The new copy decodes them first without sending their text, which restores what the old
    # one held back for a stop string, then goes on with new_token_ids.
    replay_token_ids: list[int] = []
    num_cached_tokens: int = 0  # of the prompt's, found in the prefix cache (usage reports them)


class RequestTokens(Message):
    """One completion's tokens of one step, and whether and why it ended."""

    request_id: str
    index: int = 0  # which of the request's n completions
    new_token_ids: list[int] = []
    finish_reason: FinishReason = FinishReason.NONE
    error: str = ""
    step_id: int = 0
    logprobs: list[TokenLogprobs] = []  # parallel to new_token_ids, when asked for
    queue_seconds: float = 0.0  # with a request's first update: its wait for its first step
    start: CompletionStart | None = None  # see CompletionStart: only when this copy needs it
    # The request's attempt (a migrated request is resumed as the next one; older attempts'
    # tokens are dropped), the completion's output tokens before these (a copy that has fewer
    # lost a batch), and whether `error` is the pipeline's own, which a migration may repair.
    attempt: int = 0
    num_before: int = 0
    resumable: bool = False


class TokenBatch(Message):
    """All token updates of one engine step for one detokenizer copy (one message per step and
    copy, not per token). A completion the copy cannot decode is reported to this engine
    (UnknownCompletion)."""

    engine_id: str
    items: list[RequestTokens]

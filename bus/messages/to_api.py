"""Received by the api (from the detokenizer and other api copies), with its replies."""

from __future__ import annotations

from llmbus.bus.messages.common import FinishReason, Message


class TextLogprob(Message):
    """One output token's log-probability, with its text, for the OpenAI `logprobs` fields."""

    token: str
    logprob: float
    top_tokens: list[str] = []
    top_logprobs: list[float] = []
    token_bytes: bytes = b""  # the exact bytes: `token` shows a split character as U+FFFD
    top_token_bytes: list[bytes] = []


class TextDelta(Message):
    request_id: str
    text: str
    num_new_tokens: int = 0
    finish_reason: FinishReason = FinishReason.NONE
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""
    step_id: int = 0
    index: int = 0  # which of the request's n completions
    logprobs: list[TextLogprob] = []  # one per token of this delta, when asked for
    queue_seconds: float = 0.0  # with the first delta: time waiting for the first step
    # Migration (services/api/migration.py): the token ids of this delta (its text may hold
    # some back for a stop string), the attempt they belong to, and whether an error is the
    # pipeline's (an engine or the bus failed), so that another engine may resume it.
    token_ids: list[int] = []
    attempt: int = 0
    resumable: bool = False
    detokenizer_id: str = ""  # the copy that sent it: if it dies, what it held is lost
    # An embedding request's answer (from its engine's scheduler, not a detokenizer): the
    # pooled vector as float32 bytes (little-endian), not normalised.
    embedding: bytes = b""
    # With a completion's first delta: its prompt tokens that the prefix cache held.
    num_cached_tokens: int = 0


class DeltaBatch(Message):
    items: list[TextDelta]


class ApiMetricsRequest(Message):
    pass


class RecentRequest(Message):
    """One request an api copy served lately, for the pipeline page (services/api/pipeline.py).
    `status` is "running", "finished", "aborted" (its client left) or "error"."""

    request_id: str
    replica: str
    created: float  # unix time of arrival
    status: str
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_seconds: float = -1.0  # -1: no token yet
    seconds: float = 0.0  # from arrival to its end (or to the snapshot, while running)
    trace_id: str = ""  # hex; empty when the request had no valid span context


class ApiMetricsSnapshot(Message):
    """One api copy's request metrics, in the Prometheus text format, and its recent
    requests."""

    replica: str
    exposition: str = ""
    recent_requests: list[RecentRequest] = []

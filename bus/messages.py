"""Typed messages of the pipeline, grouped by the stage that receives them.

All structs are `array_like` msgspec structs: the field order *is* the wire format. Append new
fields at the end with a default, never reorder, and pin each message with a round-trip test
(tests/test_bus_messages.py). `gc=False` because these are plain data with no cycles.
"""

from __future__ import annotations

import enum

import msgspec


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, kw_only=True):
    pass


class FinishReason(enum.IntEnum):
    NONE = 0  # still running
    STOP = 1  # eos, a stop token or a stop string
    LENGTH = 2  # max_tokens or the context window
    ABORT = 3  # the client went away or asked to cancel
    ERROR = 4  # a stage failed; `error` says why


class ErrorCode(enum.IntEnum):
    """Why a stage refused or failed a request; the api maps these to HTTP statuses."""

    INVALID_REQUEST = 1  # -> 400
    CONTEXT_LENGTH_EXCEEDED = 2  # -> 400
    OVERLOADED = 3  # -> 503
    INTERNAL = 4  # -> 500


class SamplingParams(_Msg):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16  # 0 = until the context window is full
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM/HF: divides (>0) or multiplies (<0) logits of
    #                                  tokens seen in prompt or output
    min_tokens: int = 0  # eos and stop_token_ids are suppressed until this many tokens
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k
    logit_bias: dict[int, float] = {}


class TokenLogprobs(_Msg):
    """Log-probabilities of one sampled token, from the model's raw distribution."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class ChatMessage(_Msg):
    role: str
    content: str


# ---------------------------------------------------------------- api -> tokenizer


class GenerateRequest(_Msg):
    """A request the api accepted; either `messages` (chat) or `prompt` is set."""

    request_id: str
    reply_subject: str  # where the detokenizer sends text deltas (the owning api copy)
    model: str
    params: SamplingParams
    messages: list[ChatMessage] = []
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    n: int = 1


class EncodeRequest(_Msg):
    """api -> tokenizer: the token ids of a prompt or a conversation (for /tokenize)."""

    messages: list[ChatMessage] = []
    prompt: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class EncodeResult(_Msg):
    token_ids: list[int] = []
    error_message: str = ""


class DecodeRequest(_Msg):
    """api -> tokenizer: the text of token ids (for /detokenize)."""

    token_ids: list[int]


class DecodeResult(_Msg):
    text: str = ""
    error_message: str = ""


class Admission(_Msg):
    """Reply to GenerateRequest / SubmitRequest: accepted (error_code 0) or refused."""

    num_prompt_tokens: int = 0
    error_code: int = 0
    error_message: str = ""
    error_param: str | None = None
    engine_id: str = ""  # the engine that holds the request (the api watches its heartbeat)


# ---------------------------------------------------------------- tokenizer -> scheduler


class SubmitRequest(_Msg):
    request_id: str
    reply_subject: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    n: int = 1  # completions of this prompt; they share its KV blocks


class AbortRequest(_Msg):
    request_id: str
    index: int | None = None  # one of the n completions; None = all of them


# ---------------------------------------------------------------- scheduler <-> executor


class ExecutorInfoRequest(_Msg):
    pass


class ExecutorInfo(_Msg):
    """What the executor owns: the physical KV cache geometry and the model limits."""

    model_name: str
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int]
    vocab_size: int


class NewRequestData(_Msg):
    """Sent once, in the first step that schedules a request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    traceparent: str = ""  # W3C trace context of the request: executor step spans link to it


class ScheduledRequest(_Msg):
    """One request's share of a step: compute `num_tokens` tokens from `start`.

    The executor keeps each request's tokens (prompt + what it sampled) and its block table, so
    the plan only carries deltas: blocks appended to the table since the last step. A prefill
    chunk has num_tokens > 1; a decode has num_tokens == 1 and feeds the last sampled token.
    `sample` is false for a prefill chunk that does not reach the end of the known tokens.
    """

    request_id: str
    start: int
    num_tokens: int
    new_block_ids: list[int] = []
    sample: bool = True


class BlockCopy(_Msg):
    """Copy-on-write: copy every layer's KV of block `src` into block `dst` before the step."""

    src: int
    dst: int


class StepPlan(_Msg):
    step_id: int
    new_requests: list[NewRequestData] = []
    scheduled: list[ScheduledRequest] = []
    # Requests the executor forgets (finished or aborted) before running this step.
    finished_request_ids: list[str] = []
    # Requests whose blocks were taken back: the executor clears their block tables and keeps
    # their tokens, so a later ScheduledRequest recomputes them from start 0.
    preempted_request_ids: list[str] = []
    copy_blocks: list[BlockCopy] = []


class StepResult(_Msg):
    step_id: int
    # Parallel to the plan's scheduled requests that had sample=True, in the same order.
    sampled_token_ids: list[int] = []
    forward_seconds: float = 0.0
    batch_size: int = 0
    num_tokens: int = 0
    error: str = ""
    # Time the executor sat waiting for this plan since it answered the previous one.
    idle_seconds: float = 0.0
    # Parallel to sampled_token_ids; None where the request did not ask for logprobs.
    logprobs: list[TokenLogprobs | None] = []


# ---------------------------------------------------------------- scheduler -> detokenizer


class RequestTokens(_Msg):
    request_id: str
    reply_subject: str
    new_token_ids: list[int]
    finish_reason: int = FinishReason.NONE
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


class TokenBatch(_Msg):
    """All token updates of one engine step (one message per step, not per token)."""

    engine_id: str
    items: list[RequestTokens]


# ---------------------------------------------------------------- detokenizer -> api


class TextLogprob(_Msg):
    """One output token's log-probability, with its text, for the OpenAI `logprobs` fields."""

    token: str
    logprob: float
    top_tokens: list[str] = []
    top_logprobs: list[float] = []
    token_bytes: bytes = b""  # the exact bytes: `token` shows a split character as U+FFFD
    top_token_bytes: list[bytes] = []


class TextDelta(_Msg):
    request_id: str
    text: str
    num_new_tokens: int = 0
    finish_reason: int = FinishReason.NONE
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""
    step_id: int = 0
    index: int = 0  # which of the request's n completions
    logprobs: list[TextLogprob] = []  # one per token of this delta, when asked for
    queue_seconds: float = 0.0  # with the first delta: time waiting for the first step


class DeltaBatch(_Msg):
    items: list[TextDelta]


class ModelInfoRequest(_Msg):
    pass


class ModelInfo(_Msg):
    model_name: str
    max_model_len: int
    engine_id: str


class EngineStatsRequest(_Msg):
    pass


class EngineStats(_Msg):
    engine_id: str
    num_steps: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    max_batch_size: int  # the most requests one step has carried
    num_preemptions: int
    num_finished: int
    num_cached_blocks: int = 0
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # ... of which were found there
    executor_busy_seconds: float = 0.0
    executor_idle_seconds: float = 0.0  # waiting for the next plan between steps
    num_evictable_blocks: int = 0  # cached blocks no request holds (free for the taking)


class ApiMetricsRequest(_Msg):
    pass


class ApiMetricsSnapshot(_Msg):
    """One api copy's request metrics: sample lines (Prometheus text) by metric name."""

    replica: str
    samples: dict[str, list[str]] = {}


class Heartbeat(_Msg):
    """I am alive (and this busy). Engines fill in the load fields; others leave them 0."""

    service: str
    instance_id: str
    engine_id: str = ""
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 0
    num_handled: int = 0  # work done so far (requests, batches or steps): who did what


class CacheEvent(_Msg):
    """An engine's prefix cache changed: blocks (by chained hash) stored or evicted.

    Routers keep an approximate view of what each engine caches from these; see
    bus/block_hash.py for the hash.
    """

    engine_id: str
    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False  # the engine dropped its whole cache (e.g. after a failure)
    instance_id: str = ""  # the scheduler copy (a restarted engine is a new copy)


class Ping(_Msg):
    pass


class Pong(_Msg):
    service: str
    instance_id: str
    ready: bool = True

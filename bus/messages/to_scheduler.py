"""Received by the scheduler (from the tokenizer and the api), with its replies."""

from __future__ import annotations

from llmbus.bus.messages.common import Message, SamplingParams, TokenLogprobs
from llmbus.bus.messages.to_executor import KvDestination, KvLayout


class ResumedCompletion(Message):
    """A completion that moves to another engine mid-stream: the tokens it already streamed.
    The engine computes prompt + these, goes on sampling from there, and counts them as output
    (penalties, min_tokens, max_tokens, the grammar, a seed's position)."""

    index: int
    output_token_ids: list[int] = []


class SubmitRequest(Message):
    request_id: str
    reply_subject: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0  # the tokenizer's clock, for its logs; engines use their own
    n: int = 1  # completions of this prompt; they share its KV blocks
    # A migrated request: its attempt (0 the first time), and, when it resumes, each unfinished
    # completion with what it already streamed (empty: all n start afresh).
    attempt: int = 0
    resumed: list[ResumedCompletion] = []
    avoid_detokenizer_ids: list[str] = []  # as in GenerateRequest


class AbortRequest(Message):
    request_id: str
    index: int | None = None  # one of the n completions; None = all of them
    up_to_attempt: int | None = None  # only attempts up to this one (None: every attempt)


class UnknownCompletion(Message):
    """A detokenizer copy got tokens of a completion it holds nothing of, and no `start` with
    them (the message that had it was lost): it cannot decode them into the right text, so the
    engine ends the completion with an error, sent to that copy with its start."""

    request_id: str
    index: int = 0
    instance_id: str = ""  # the detokenizer copy


class EngineStatsRequest(Message):
    pass


class EngineStats(Message):
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
    num_draft_tokens: int = 0  # speculative decoding: n-gram drafts sent for verification
    num_accepted_tokens: int = 0  # ... of which the model agreed with
    # Disaggregated serving: a decode engine's prompts prefilled elsewhere, those it took back
    # (the prefill engine failed or was slow), the KV bytes and seconds they moved in, and the
    # handoffs' seconds (the prefill engine's first token to this engine's sending it on).
    num_remote_prefills: int = 0
    num_remote_fallbacks: int = 0
    kv_bytes_received: int = 0
    kv_transfer_seconds: float = 0.0
    handoff_seconds: float = 0.0
    num_prefilled_for_others: int = 0  # a prefill engine's
    num_prefill_engines: int = 0  # a decode engine's: prefill engines it hears from now
    kv_wait_seconds: float = 0.0  # PrefillDone.wait_seconds, summed
    num_generated_tokens: int = 0  # output tokens sampled since start (a rate by difference)


class ModelInfoRequest(Message):
    pass


class ModelInfo(Message):
    model_name: str
    max_model_len: int
    engine_id: str


class PrefillRequest(Message):
    """decode scheduler -> a prefill engine's scheduler (request/reply, `PrefillReply`):
    compute this prompt's KV into my blocks (`destination`) and sample its first token."""

    request_id: str  # the api's, for logs and traces
    attempt: int
    prompt_token_ids: list[int]
    params: SamplingParams
    destination: KvDestination
    layout: KvLayout  # the decode engine's cache; a different one is refused
    reply_subject: str  # where PrefillDone goes (the decode engine's engine_prefilled)
    traceparent: str = ""  # the request's: the prefill engine's spans join its trace


class PrefillReply(Message):
    error: str = ""  # empty: accepted


class PrefillDone(Message):
    """prefill scheduler -> decode scheduler: every block of the transfer is in the decode
    engine's cache (its executor acknowledged them), and here is the first token; or `error`.
    """

    transfer_id: str
    token_id: int = -1
    logprobs: TokenLogprobs | None = None
    error: str = ""
    num_bytes: int = 0
    transfer_seconds: float = 0.0
    prefill_seconds: float = 0.0  # on the prefill engine, from accepted to done
    sampled_at: float = 0.0  # the prefill engine's wall clock when its step answered
    wait_seconds: float = 0.0  # KvTransferReport.wait_seconds

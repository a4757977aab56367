"""The scheduler's view of one request (or one of the n completions of a request)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llmbus.bus.messages import FinishReason, KvDestination, SamplingParams, TokenLogprobs
from llmbus.services.scheduler.ngram_proposer import NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE = "remote"  # holds its blocks while another engine prefills it (remote_prefills.py)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    sequence_id: str  # unique inside the engine; a completion of n > 1 is "<request_id>#<index>"
    request_id: str  # the api's id of the prompt, which the detokenizer and aborts use too
    index: int  # which of the request's completions this is
    reply_subject: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never beyond the context window or the cache
    arrival_time: float = 0.0
    # n > 1: this request only prefills the prompt up to `fork_at` tokens, then forks into
    # n completions that share those blocks.
    num_forks: int = 1
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when asked for
    # Sampled in a step whose result has not arrived yet (the scheduler plans ahead).
    num_pending_tokens: int = 0
    # Tokens whose KV is (or, once the planned steps ran, will be) in the cache.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table inserted in the prefix tree
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason = FinishReason.NONE
    known_to_executor: bool = False
    num_blocks_sent: int = 0  # leading blocks of block_table the executor already has
    num_sent_tokens: int = 0  # output tokens already sent to the detokenizer
    start_sent: bool = False  # its first update (with the CompletionStart) went out
    attempt: int = 0  # a migrated request's attempt (bus/messages/to_scheduler.py)
    num_preemptions: int = 0
    # Disaggregated prefill: on a decode engine, the try under way (remote_prefills.py) and
    # whether to prefill here from now on (a try failed); on a prefill engine, where its KV goes.
    transfer_id: str = ""
    local_only: bool = False
    kv_destination: KvDestination | None = None
    # ... each try, for traces: (prefill engine, started, ended, KV bytes; 0 if given up)
    remote_prefills: list[tuple[str, float, float, int]] = field(default_factory=list)
    # For traces and metrics; times are whatever clock the caller passes (no clock here).
    traceparent: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    # Speculative decoding: drafts of the step in flight (none other is planned meanwhile),
    # the totals, and a back-off after steps that accepted nothing.
    draft_token_ids: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_misses: int = 0
    spec_resume_at: int = 0  # no drafts before this many output tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the executor will hold once every planned step ran."""
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_parent(self) -> bool:
        return self.num_forks > 1

    @property
    def target_tokens(self) -> int:
        """How far computed tokens should catch up: a parent stops before its last token."""
        return self.num_prompt_tokens - 1 if self.is_parent else self.num_tokens

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

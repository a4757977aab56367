"""The scheduler's view of one request (or one of the n completions of a request).

`Request` holds what every request has: who it is, its prompt and output, its KV blocks and
how far they are computed. What a feature adds to a request rides in a small struct of that
feature: `spec` (speculation.py), `remote` (disaggregation/), `trace` (spans.py) and `sent`
(what the executor and the detokenizer were told already). The structs are declared here, not
in their features' modules, because those modules read the whole request (and a module that
imports this one cannot be imported by it: tests/project/test_code_shape.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llmbus.bus.messages import FinishReason, KvDestination, SamplingParams, TokenLogprobs
from llmbus.services.scheduler.ngram_proposer import NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE = "remote"  # holds its blocks while another engine prefills it (disaggregation/)
    FINISHED = "finished"


@dataclass
class Speculation:
    """Speculative decoding (speculation.py): the drafts of the step in flight (none other is
    planned meanwhile), the totals, and a back-off after steps that accepted nothing."""

    draft_token_ids: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None  # built at its first lookup
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_misses: int = 0  # steps in a row that accepted no draft
    resume_at: int = 0  # no drafts before this many output tokens


@dataclass
class RemotePrefillState:
    """Disaggregated prefill (disaggregation/): on a decode engine, the try under way and
    whether to prefill here from now on (a try failed, or the rule kept it here); on a prefill
    engine, where its KV goes."""

    transfer_id: str = ""  # the try under way (disaggregation/tries.py), "" if none
    local_only: bool = False
    kv_destination: KvDestination | None = None
    # Each try, for traces: (prefill engine, started, ended, KV bytes; 0 if given up)
    tries: list[tuple[str, float, float, int]] = field(default_factory=list)


@dataclass
class Trace:
    """What the request's trace records (spans.py) and the metrics read: its trace context and
    the times the scheduler stamps, on whatever clock the caller passes (no clock here)."""

    traceparent: str = ""
    arrival_time: float = 0.0  # also orders the running batch (newest preempted first)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache had when it was first scheduled


@dataclass
class Sent:
    """What went out already, so that each message carries only what is new: the executor
    gets a request's data once and then only its new blocks; the detokenizer only new
    tokens (with their logprobs, when asked for, held here until they go), and the
    completion's start once."""

    to_executor: bool = False  # its NewRequestData went out
    num_blocks: int = 0  # leading blocks of block_table the executor already has
    num_tokens: int = 0  # output tokens already sent to the detokenizer
    start: bool = False  # its first update (with the CompletionStart) went out
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of tokens not sent yet


@dataclass(eq=False)
class Request:
    sequence_id: str  # unique inside the engine; a completion of n > 1 is "<request_id>#<index>"
    request_id: str  # the api's id of the prompt, which the detokenizer and aborts use too
    index: int  # which of the request's completions this is
    reply_subject: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never beyond the context window or the cache
    # n > 1: this request only prefills the prompt but its last token, then forks into n
    # completions that share those blocks.
    num_forks: int = 1
    attempt: int = 0  # a migrated request's attempt (bus/messages/to_scheduler.py)
    output_token_ids: list[int] = field(default_factory=list)
    # Sampled in a step whose result has not arrived yet (the scheduler plans ahead).
    num_pending_tokens: int = 0
    # Tokens whose KV is (or, once the planned steps ran, will be) in the cache.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table inserted in the prefix tree
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason = FinishReason.NONE
    spec: Speculation = field(default_factory=Speculation)
    remote: RemotePrefillState = field(default_factory=RemotePrefillState)
    trace: Trace = field(default_factory=Trace)
    sent: Sent = field(default_factory=Sent)

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
    def embeds(self) -> bool:
        """An embedding request: its prompt is computed and pooled (by the executor), nothing
        sampled; it ends when the step that computed the prompt's end answers."""
        return bool(self.params.pooling)

    @property
    def target_tokens(self) -> int:
        """How far computed tokens should catch up: a parent stops before its last token."""
        return self.num_prompt_tokens - 1 if self.is_parent else self.num_tokens

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class Embedded:
    """An embedding request that ended: its pooled vector (float32 bytes), or why not."""

    request: Request
    vector: bytes = b""
    error: str = ""

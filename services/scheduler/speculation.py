"""Speculative decoding in the scheduler: which requests get drafts, and what a verified step
leaves behind.

A request with drafts is scheduled as one query: its last sampled token, then the d drafts,
with KV blocks for all of them. No other step is planned for it until the result says how many
drafts the model agreed with (a, 0..d): it then holds a + 1 new tokens, the KV of the first a
+ 1 positions is valid and that of the rejected drafts is overwritten later. The prefix cache
only ever takes blocks of known tokens, so it never holds a draft's KV.

With steps planned ahead (pipeline depth 2) a request's next token is unknown while its step
runs, and drafts must follow it: a request whose known tokens already match earlier context
skips one planned step to wait for that token, then gets drafts. Requests without drafts are
planned ahead as usual, so speculation costs workloads that never repeat themselves nothing but
the lookups. A step whose drafts were all rejected makes the request wait 8, 16, 32, ... more
tokens (up to 512) before it speculates again.
"""

from __future__ import annotations

from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.ngram_proposer import NgramIndex
from llmbus.services.scheduler.request import Request

FIRST_BACKOFF_TOKENS = 8
MAX_BACKOFF_SHIFT = 6


def may_speculate(request: Request, config: SchedulerConfig) -> bool:
    """Drafts are for a completion's decode steps (not a parent's, which never samples),
    unless it is backing off after misses. A constrained completion gets none: its grammar
    matcher in the executor only moves forward (services/executor/constraints.py)."""
    return (config.num_speculative_tokens > 0 and not request.is_parent
            and request.params.structured is None
            and len(request.output_token_ids) >= request.spec.resume_at)


def propose(request: Request, config: SchedulerConfig, limit: int) -> list[int]:
    """Up to `limit` drafts to follow the request's known tokens."""
    if limit < 1:
        return []
    spec = request.spec
    if spec.ngram_index is None:
        spec.ngram_index = NgramIndex(config.spec_ngram_min, config.spec_ngram_max)
    return spec.ngram_index.propose(request.prompt_token_ids, request.output_token_ids, limit)


def drafts_for(request: Request, config: SchedulerConfig, budget: int) -> list[int]:
    """Drafts for a request about to decode its next token (all of its tokens known, all but
    the last computed), within max_tokens and the step's token budget."""
    if (request.num_pending_tokens or request.num_computed_tokens != request.num_known_tokens - 1
            or not may_speculate(request, config)):
        return []
    room = request.max_tokens - len(request.output_token_ids) - 1  # the verified step adds 1
    return propose(request, config, min(config.num_speculative_tokens, room, budget - 1))


def waits_for_drafts(request: Request, config: SchedulerConfig) -> bool:
    """A request whose token is still on the way, but whose context already repeats itself:
    better to skip one planned step and speculate from that token than to plan ahead."""
    return (request.num_pending_tokens > 0 and may_speculate(request, config)
            and bool(propose(request, config, 1)))


def verified(request: Request, start: int, num_tokens: int, num_accepted: int) -> None:
    """The step [start, start + num_tokens) with the request's drafts came back with
    `num_accepted` of them agreed: forget the rejected drafts' KV, back off after a miss."""
    spec = request.spec
    num_drafts = len(spec.draft_token_ids)
    spec.draft_token_ids = []
    spec.num_draft_tokens += num_drafts
    spec.num_accepted_tokens += num_accepted
    if request.num_computed_tokens == start + num_tokens:  # not preempted meanwhile
        request.num_computed_tokens -= num_drafts - num_accepted
    if num_accepted:
        spec.num_misses = 0
        return
    shift = min(spec.num_misses, MAX_BACKOFF_SHIFT)
    spec.num_misses += 1
    spec.resume_at = len(request.output_token_ids) + 1 + (FIRST_BACKOFF_TOKENS << shift)

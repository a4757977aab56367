"""Speculative decoding inside a step: the logits rows a request with drafts needs, and the
verification of its drafts against them (sampling/speculative.py holds the rule).

A request with d drafts computes d + 1 logits rows, at its last d + 1 query positions: the
last known token's (which predicts the first draft), each draft's but the last's, and the last
draft's (which predicts the token after them all). A request without drafts computes one row,
at its last position. Rows come in the plan's order of its sampling requests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmbus.bus.messages import ScheduledRequest, TokenLogprobs
from llmbus.services.executor.request_state import RequestState, seed_positions
from llmbus.services.executor.sampling.logprobs import token_logprobs
from llmbus.services.executor.sampling.penalties import TokenCounts
from llmbus.services.executor.sampling.sampled_tokens import SampledTokens
from llmbus.services.executor.sampling.speculative import position_tensors, verify


def logits_indices(last: torch.Tensor, samplers: list[ScheduledRequest]) -> torch.Tensor:
    """The query positions whose logits are computed, from `last` [S], each sampler's last
    query position: `last` itself without drafts; with them, d + 1 positions per sampler."""
    if not any(s.draft_token_ids for s in samplers):
        return last
    back = [j for s in samplers for j in range(len(s.draft_token_ids), -1, -1)]
    counts = torch.tensor([len(s.draft_token_ids) + 1 for s in samplers], device=last.device)
    return last.repeat_interleave(counts) - torch.tensor(back, device=last.device)


def sample_with_drafts(logits: torch.Tensor, samplers: list[ScheduledRequest],
                       states: list[RequestState],
                       sample: Callable[[torch.Tensor, list[RequestState]], SampledTokens],
                       token_counts: TokenCounts, shared_generator: torch.Generator,
                       ) -> SampledTokens:
    """Samplers without drafts sample as usual (`sample`, over their rows only); the others
    verify their drafts. `logits` [sum(d + 1), V]: 1 row per plain sampler, d + 1 per one with
    d drafts. Appends each request's tokens to its state."""
    firsts, row = [], 0
    for s in samplers:
        firsts.append(row)
        row += len(s.draft_token_ids) + 1
    plain = [i for i, s in enumerate(samplers) if not s.draft_token_ids]
    plain_tokens, plain_logprobs = iter([]), iter([])
    if plain:
        rows = torch.tensor([firsts[i] for i in plain], device=logits.device)
        sampled = sample(logits.index_select(0, rows), [states[i] for i in plain])
        plain_tokens = iter(sampled.token_ids)
        plain_logprobs = iter(sampled.logprobs or [None] * len(sampled.token_ids))
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    num_sampled: list[int] = []
    for i, (sched, state) in enumerate(zip(samplers, states, strict=True)):
        if not sched.draft_token_ids:
            token_ids.append(next(plain_tokens))
            logprobs.append(next(plain_logprobs))
            num_sampled.append(1)
            continue
        rows = logits[firsts[i]:firsts[i] + len(sched.draft_token_ids) + 1]
        tokens, token_lps = _verify_one(rows, list(sched.draft_token_ids), state, token_counts,
                                        shared_generator)
        token_ids += tokens
        logprobs += token_lps
        num_sampled.append(len(tokens))
    return SampledTokens(token_ids, [] if all(lp is None for lp in logprobs) else logprobs,
                         num_sampled)


def _verify_one(rows: torch.Tensor, drafts: list[int], state: RequestState,
                token_counts: TokenCounts, shared_generator: torch.Generator,
                ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One request's drafts against its d + 1 rows [d + 1, V]: the drafts accepted and the
    token after them, appended to its tokens (and penalty counts), with their logprobs."""
    seen = None
    if state.penalty_slot is not None:
        seen_ids, output_counts = token_counts.gather([state.penalty_slot])
        seen = dict(zip(seen_ids[0].tolist(), output_counts[0].tolist(), strict=True))
    tensors = position_tensors(state.sampling, state.num_output_tokens, drafts, seen,
                               rows.device)
    seed_positions([state])
    tokens = verify(rows, drafts, tensors, state.generator or shared_generator)
    for token in tokens:
        state.token_ids.append(token)
        if state.penalty_slot is not None:
            token_counts.record([state.penalty_slot], [token])
    logprobs = token_logprobs(rows[:len(tokens)], torch.tensor(tokens, device=rows.device),
                              [state.sampling.num_logprobs] * len(tokens))
    return tokens, logprobs or [None] * len(tokens)

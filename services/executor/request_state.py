"""What the executor keeps of each live sequence between steps, and what a step's share of it
must satisfy.

The runner keeps each sequence's tokens and block table, so plans carry only deltas (new
requests once, new block ids, token ranges to compute). A sequence's state is registered by
the plan that brings it (`NewRequestData`), grows by the tokens it samples, and is forgotten
when a plan says it finished; a preempted one keeps its tokens and loses its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmbus.bus.messages import SamplingParams, ScheduledRequest
from llmbus.services.executor.embedding_pooling import Pooling
from llmbus.services.executor.grammar_state import GrammarState
from llmbus.services.executor.sampling.sampling_tensors import RequestSampling


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + sampled tokens
    num_prompt_tokens: int
    params: SamplingParams
    sampling: RequestSampling
    generator: torch.Generator | None  # only for seeded requests
    penalty_slot: int | None  # its row in the runner's TokenCounts, if it has penalties
    block_table: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None  # constrained decoding: where its grammar is
    pooling: Pooling | None = None  # an embedding request: its prompt's pooling so far

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def constrained(self) -> bool:
        """Whether its next token is masked by its grammar."""
        return self.grammar is not None and self.grammar.constrained


def seed_positions(states: list[RequestState]) -> None:
    """Seed each seeded request's generator for the output position it samples now: its draws
    depend on (seed, position) alone, so a request resumed at position k on another engine
    (migrated) goes on exactly as it would have, and so does one sharing a batch."""
    for state in states:
        if state.generator is not None:
            seed = state.params.seed or 0
            state.generator.manual_seed((seed * 1_000_003 + state.num_output_tokens)
                                        % (1 << 63))


def check_scheduled(sched: ScheduledRequest, state: RequestState, block_size: int,
                    max_model_len: int) -> None:
    """Refuse (ValueError) a share of a step that the request's tokens and blocks cannot serve.
    `state.block_table` already has the share's new blocks."""
    end = sched.start + sched.num_tokens
    known_end = end - len(sched.draft_token_ids)
    name = f"sequence {sched.sequence_id!r}"
    if sched.draft_token_ids and (not sched.sample or known_end <= sched.start):
        raise ValueError(f"{name}: drafts must follow a known token of a step that samples")
    if sched.num_steps > 1 and (sched.draft_token_ids or not sched.sample
                                or sched.num_tokens != 1):
        raise ValueError(f"{name}: several steps are for a plain decode (one token, sampled, "
                         "no drafts)")
    end += sched.num_steps - 1  # the positions the further steps write
    if sched.num_tokens < 1 or sched.start < 0 or known_end > len(state.token_ids):
        raise ValueError(f"{name}: tokens [{sched.start}, {known_end}) outside its "
                         f"{len(state.token_ids)} known tokens")
    if sched.sample and known_end != len(state.token_ids):
        raise ValueError(f"{name}: sampling after token {end} of {len(state.token_ids)} "
                         "would skip known tokens")
    if end > max_model_len:
        raise ValueError(f"{name}: {end} tokens exceed max_model_len {max_model_len}")
    if len(state.block_table) * block_size < end:
        raise ValueError(f"{name}: {len(state.block_table)} blocks cannot hold {end} tokens")

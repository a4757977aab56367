"""What one step sampled: the token ids, their logprobs and how many each request got."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmbus.bus.messages import TokenLogprobs


@dataclass(frozen=True)
class SampledTokens:
    """The step's sampling requests in plan order. `token_ids`: one per request, or
    `num_sampled[i]` consecutive ones for request i (drafts verified, several steps taken);
    `num_sampled` empty means one each. `logprobs`: parallel to `token_ids`, None where the
    request did not ask, and empty when no request asked. The fields of StepResult of the same
    names, so the service copies them over as they are."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_sampled: list[int] = field(default_factory=list)

"""Multi-step decoding: a plan's plain decodes may ask for several steps (`num_steps`), which
the executor takes back to back, each forward feeding a request its own last token, so the
scheduler pays one round trip for several tokens. Each forward's tokens but the last's are also
handed to `progress` as they are sampled (the service publishes them: StepProgress), so that
they stream at the forwards' pace."""

from __future__ import annotations

from collections.abc import Callable

from llmbus.bus.messages import ScheduledRequest, TokenLogprobs
from llmbus.services.executor.sampling.sampled_tokens import SampledTokens


def more_steps(scheduled: list[ScheduledRequest], first: SampledTokens,
               forward: Callable[[list[ScheduledRequest]], SampledTokens],
               num_known_tokens: Callable[[str], int],
               progress: Callable[[int, SampledTokens], None] = lambda _, __: None,
               ) -> SampledTokens:
    """After the plan's forward (`first`: its samplers' tokens, one each), the further steps of
    the requests that asked for them: one `forward` per step over those still going. Returns
    every sampler's tokens in plan order, with their counts; `progress(k, tokens)` has forward
    k's tokens (those still going, in plan order) as soon as they are sampled, the last
    forward's excepted (the result follows at once)."""
    samplers = [s for s in scheduled if s.sample]
    num_forwards = max(s.num_steps for s in samplers)
    progress(0, first)
    tokens = {s.sequence_id: [t] for s, t in zip(samplers, first.token_ids, strict=True)}
    with_logprobs = bool(first.logprobs)
    logprobs: dict[str, list[TokenLogprobs | None]] = {
        s.sequence_id: [lp] for s, lp in zip(
            samplers, first.logprobs or [None] * len(samplers), strict=True)}
    for step in range(1, num_forwards):
        batch = [ScheduledRequest(sequence_id=s.sequence_id, num_tokens=1,
                                  start=num_known_tokens(s.sequence_id) - 1)
                 for s in samplers if s.num_steps > step]
        sampled = forward(batch)
        if step < num_forwards - 1:
            progress(step, sampled)
        with_logprobs = with_logprobs or bool(sampled.logprobs)
        for s, token, lp in zip(batch, sampled.token_ids,
                                sampled.logprobs or [None] * len(batch), strict=True):
            tokens[s.sequence_id].append(token)
            logprobs[s.sequence_id].append(lp)
    order = [s.sequence_id for s in samplers]
    return SampledTokens([t for r in order for t in tokens[r]],
                         [lp for r in order for lp in logprobs[r]] if with_logprobs else [],
                         [len(tokens[r]) for r in order])

"""Multi-step decoding: a plan's plain decodes may ask for several steps (`num_steps`), which
the executor takes back to back, each forward feeding a request its own last token, so the
scheduler pays one round trip for several tokens. The forwards' tokens also go out while the
plan runs (ProgressStream: a StepProgress every STREAM_INTERVAL_SECONDS at most), so that a
stream's text comes at about the pace of its forwards, not a plan's worth at a time.

Why an interval and not every forward: each message is a hop through the scheduler, the
detokenizer and the api, whose CPU a small machine takes from the forwards. One stream of the
default model on 2 cores (Intel Xeon model 167): every 6.6 ms forward streamed, TPOT 7.2 ms and
ITL p99 15 ms; a plan's worth at a time, 6.6 and 120 ms. Why 16 ms: a screen shows text at most
60 times a second, so sooner is not seen; and the messages' CPU still cost a lone stream a
fifth of its speed at 10 ms (2 Zen 4 cores, 5.5-6 ms forwards, two runs each, TPOT / ITL p99:
every 10 ms 7.9 / 25.0 and 7.5 / 23.2 ms; 16 ms 7.3 / 28.6 and 7.1 / 27.4; 20 ms 6.6 / 32.4 and
7.0 / 32.6; only at a plan's end, 6.0-7.0 / 72-85).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmbus.bus.messages import ScheduledRequest, StepProgress, TokenLogprobs
from llmbus.services.executor.sampling.sampled_tokens import SampledTokens

STREAM_INTERVAL_SECONDS = 0.016  # a plan's tokens go out at most this often while it runs


class ProgressStream:
    """A plan's forwards' tokens, published (`publish`) as one StepProgress of every forward
    since the last one once STREAM_INTERVAL_SECONDS have passed since tokens last went out
    (`since`: the plan before's result; default: now) or the last message went; never after
    the plan's last forward, whose result follows at once.

    Why from the result before and not from the plan's start: the cadence then runs on over
    the plans' seams. From the start, a lone stream of 6.5 ms forwards in 7-forward plans got
    its text 22.5, 19.5 and 6.5 ms apart (the round trip between plans, ~3 ms, added to the
    first gap); from the result, 16, 19.5 and 13, with as many messages."""

    def __init__(self, step_id: int, publish: Callable[[StepProgress], None],
                 interval: float | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 since: float | None = None) -> None:
        self.step_id, self.publish, self.clock = step_id, publish, clock
        self.interval = STREAM_INTERVAL_SECONDS if interval is None else interval
        self.first = 0  # the first forward not published yet
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs | None] = []
        self.last = clock() if since is None else since

    def __call__(self, forward: int, sampled: SampledTokens) -> None:
        """Forward `forward` (not the plan's last) sampled these."""
        self.token_ids += sampled.token_ids
        self.logprobs += sampled.logprobs or [None] * len(sampled.token_ids)
        now = self.clock()
        if now - self.last < self.interval:
            return
        self.publish(StepProgress(
            step_id=self.step_id, forward=self.first, num_forwards=forward + 1 - self.first,
            sampled_token_ids=self.token_ids,
            logprobs=self.logprobs if any(lp is not None for lp in self.logprobs) else []))
        self.first, self.token_ids, self.logprobs, self.last = forward + 1, [], [], now


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

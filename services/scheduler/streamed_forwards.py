"""Tokens of a multi-step plan streamed as its forwards sample them (multi_step.py): which
requests a StepProgress speaks of, and how many of each request's tokens went out before the
plan's StepResult, which carries them all again.

The executor publishes a StepProgress every few forwards of a plan of several (never after its
last); the scheduler appends those tokens and sends them on at once, so a stream's text comes
at about the pace of its forwards, not a plan's worth at a time. Progress is taken only in
order and only for the plan being awaited; anything else (lost, late, repeated) is left to the
StepResult, which then brings the tokens the progress did not."""

from __future__ import annotations

from collections.abc import Iterator

from llmbus.bus.messages import ScheduledRequest, StepPlan, StepProgress, TokenLogprobs


class StreamedForwards:
    """What was streamed of one plan: its forwards taken, and tokens per sequence."""

    def __init__(self) -> None:
        self.step_id = -1
        self.num_forwards = 0
        self.num_tokens: dict[str, int] = {}

    def take(self, plan: StepPlan, progress: StepProgress
             ) -> Iterator[tuple[ScheduledRequest, int, TokenLogprobs | None]]:
        """The (plan item, token, logprobs) of a progress's forwards; none if they do not
        start at this plan's next forward, or do not match its shape."""
        if self.step_id != plan.step_id:
            self.step_id, self.num_forwards, self.num_tokens = plan.step_id, 0, {}
        forwards = range(progress.forward, progress.forward + progress.num_forwards)
        going = [i for k in forwards for i in plan.scheduled if i.sample and i.num_steps > k]
        tokens = progress.sampled_token_ids
        logprobs = progress.logprobs or [None] * len(tokens)
        if (progress.forward != self.num_forwards or len(going) != len(tokens)
                or len(logprobs) != len(tokens)):
            return
        self.num_forwards = forwards.stop
        for item, token, token_logprobs in zip(going, tokens, logprobs, strict=True):
            self.num_tokens[item.sequence_id] = self.num_tokens.get(item.sequence_id, 0) + 1
            yield item, token, token_logprobs

    def sent_of(self, plan: StepPlan) -> dict[str, int]:
        """Tokens per sequence already taken from this plan's progress (the result's are
        after them), forgetting them: the plan is done."""
        sent = self.num_tokens if self.step_id == plan.step_id else {}
        self.step_id, self.num_forwards, self.num_tokens = -1, 0, {}
        return sent

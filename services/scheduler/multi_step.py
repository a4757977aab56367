"""Multi-step decoding: a small batch of decodes takes several tokens a step.

At one stream, every token otherwise costs a plan, a result, a token batch and a text delta on
the bus, and the CPU time of five processes to pass them on (about 2.3 ms a token on 2 Zen 4
cores, beside a 6 ms forward, docs/benchmarks.md); on a machine of few cores that CPU comes out
of the forward's threads. With s steps a plan, the executor runs s forwards in a row, feeding
each the token the one before sampled, and the bus carries one message of each kind per s
tokens. Only while nothing waits and the batch is small: a request that arrives meanwhile waits
for those steps (at most `--decode-plan-ms`, 80 by default, which caps s by the forward time
learnt so far; the engine loop plans nothing behind such a step, so it is one plan's wait,
not two), and a big batch's per-token
bus cost is already shared by its many tokens. Tokens past a stop come back and are dropped,
as after drafts: at the end of a request, up to s - 1 forwards of its step. The further steps
never preempt anyone: without the blocks for them, a request takes one step.
"""

from __future__ import annotations

from llmbus.bus.messages import StepPlan
from llmbus.services.scheduler.config import MULTI_STEP_MAX_BATCH, SchedulerConfig
from llmbus.services.scheduler.request import Request

SMOOTHING = 0.2  # weight of the newest forward time in the running average


class DecodePace:
    """How long one forward of a small decode batch takes, learnt from the executor's answers,
    so that a plan of several steps lasts about `config.decode_plan_seconds`: 8 steps of a 6 ms
    forward, but one step of a big model's 60 ms one, whose text would otherwise come in half-
    second bursts (and whose per-token bus cost is small beside its forward anyway)."""

    def __init__(self) -> None:
        self.forward_seconds: float | None = None  # None until a decode-only step answered

    def observe(self, plan: StepPlan, forward_seconds: float) -> None:
        """Learn from a step's answer if it was small decodes only (no prompt, no drafts)."""
        items = plan.scheduled
        if not items or len(items) > MULTI_STEP_MAX_BATCH or any(i.num_tokens != 1 for i in items):
            return
        one = forward_seconds / max(i.num_steps for i in items)
        self.forward_seconds = one if self.forward_seconds is None else (
            self.forward_seconds + SMOOTHING * (one - self.forward_seconds))

    def max_steps(self, config: SchedulerConfig) -> int:
        """Steps a plan may take now: up to `decode_steps`, fewer when forwards are slow."""
        if not self.forward_seconds or self.forward_seconds <= 0:
            return config.decode_steps
        fit = int(config.decode_plan_seconds / self.forward_seconds)
        return max(1, min(config.decode_steps, fit))


def multi_step_decode(config: SchedulerConfig, num_running: int, num_waiting: int) -> bool:
    """Whether this step's decodes may take several steps."""
    return (config.decode_steps > 1 and num_waiting == 0 and num_running <= MULTI_STEP_MAX_BATCH
            and config.num_speculative_tokens == 0)


def decode_steps(request: Request, config: SchedulerConfig, budget: int, most: int) -> int:
    """Steps for a request about to decode its next token (all but its last token computed),
    at most `most`, within max_tokens and the step's token budget; 1 for anything else."""
    if (request.is_parent or request.draft_token_ids
            or request.num_computed_tokens != request.num_tokens - 1):
        return 1
    room = request.max_tokens - len(request.output_token_ids) - request.num_pending_tokens
    return max(1, min(most, room, budget))

"""Multi-step decoding: a small batch of decodes takes several tokens a step.

At one stream, every token otherwise costs a plan, a result, a token batch and a text delta on
the bus, and the CPU time of five processes to pass them on (about 2.3 ms a token on 2 Zen 4
cores, beside a 6 ms forward, docs/benchmarks.md); on a machine of few cores that CPU comes out
of the forward's threads. With s steps a plan, the executor runs s forwards in a row, feeding
each the token the one before sampled, and the bus carries one message of each kind per s
tokens. Only while nothing waits and the batch is small: a request that arrives meanwhile waits
for those steps (at most `--decode-plan-ms`, 50 by default, which caps s by the forward time
step_time.py predicts for those decodes; the engine loop plans nothing behind such a step, so
it is one plan's wait, not two), and a big batch's per-token bus cost is already shared by its
many tokens. The same cap keeps the stream's cadence: its text comes at most that long apart.
Tokens past a stop come back and are dropped, as after drafts: at the end of a request, up to
s - 1 forwards of its step. The further steps never preempt anyone: without the blocks for
them, a request takes one step.
"""

from __future__ import annotations

from llmbus.services.scheduler.config import MULTI_STEP_MAX_BATCH, SchedulerConfig
from llmbus.services.scheduler.request import Request


def max_decode_steps(config: SchedulerConfig, forward_seconds: float | None) -> int:
    """Steps a plan may take now: up to `decode_steps`, fewer when one forward of the running
    decodes (predicted by step_time.py; None before anything was timed) is slow."""
    if not forward_seconds or forward_seconds <= 0:
        return config.decode_steps
    fit = int(config.decode_plan_seconds / forward_seconds)
    return max(1, min(config.decode_steps, fit))


def multi_step_decode(config: SchedulerConfig, num_running: int, num_waiting: int) -> bool:
    """Whether this step's decodes may take several steps."""
    return (config.decode_steps > 1 and num_waiting == 0 and num_running <= MULTI_STEP_MAX_BATCH
            and config.num_speculative_tokens == 0)


def decode_steps(request: Request, config: SchedulerConfig, budget: int, most: int) -> int:
    """Steps for a request about to decode its next token (all but its last token computed),
    at most `most`, within max_tokens and the step's token budget; 1 for anything else."""
    if (request.is_parent or request.spec.draft_token_ids
            or request.num_computed_tokens != request.num_tokens - 1):
        return 1
    room = request.max_tokens - len(request.output_token_ids) - request.num_pending_tokens
    return max(1, min(most, room, budget))

"""When a decode engine sends a prompt's prefill to a prefill engine: the rule, per request.

Prefill elsewhere pays only where it keeps this engine's decodes from stalling and the first
token comes sooner, so it must win on every count (Dynamo's conditional disaggregation):

- `eligible`: one plain completion (n = 1, no constraint, nothing resumed);
- the effective prompt (the tokens after the prefix this engine caches) is at least
  `min_tokens` long, and at most `max_cached_fraction` of the prompt is cached here;
- a prefill engine is alive, has room for the prompt's blocks (free or evictable), and has at
  most `max_queued_tokens` prompt tokens still to compute (what its heartbeat said, plus what
  this engine sent it since);
- the predicted time to the first token is shorter there: its backlog, the whole prompt's
  prefill at its full token budget (this engine's cached prefix is not there), the transfer
  of the blocks after that prefix and a handover, against the prefill of the rest here in
  chunks beside this engine's decodes (steps capped by --max-step-ms). Both come from this
  engine's step-time model (step_time.py): the engines are alike, since blocks move only
  between equal layouts. Until the model has learnt, the rule sends a prompt away only while
  this engine decodes (its decodes would stall).

`always` skips the length, cache and time tests (the benchmark's 1 prefill + 1 decode);
`never` is an engine that prefills everything itself. Pure: no bus, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmbus.bus.messages import Heartbeat
from llmbus.services.scheduler.request import Request
from llmbus.services.scheduler.step_time import StepBudget, StepShape, StepTimeModel

MODES = ("auto", "always", "never")
MAX_SIMULATED_STEPS = 512  # a local prefill's prediction walks at most this many chunks


@dataclass(frozen=True)
class DisaggregationRule:
    mode: str = "auto"
    min_tokens: int = 1024
    max_cached_fraction: float = 0.5
    max_queued_tokens: int = 8192
    handover_seconds: float = 0.02  # the round trips of a remote prefill, besides the bytes
    kv_bytes_per_token: int = 0  # the cache's: transfer time = bytes / bandwidth
    bytes_per_second: float = 300e6  # the bus's on loopback (bench/kv_transfer.py, Zen 4)


@dataclass(frozen=True)
class Decision:
    engine: Heartbeat | None  # the prefill engine, or None: prefill here
    reason: str  # why, for logs and tests
    weighed: bool = False  # long and uncached enough that the engines were compared


def eligible(request: Request) -> bool:
    return (not request.is_parent and not request.output_token_ids
            and request.params.structured is None and request.index == 0)


def decide(rule: DisaggregationRule, request: Request, num_cached_tokens: int,
           prefill_engines: list[Heartbeat], model: StepTimeModel, decodes: StepShape,
           token_budget: int, max_step_seconds: float) -> Decision:
    """Where this waiting request's prompt is prefilled (the whole rule: see the module)."""
    if rule.mode == "never" or not eligible(request):
        return Decision(None, "not disaggregated")
    num_prompt = request.num_prompt_tokens
    effective = num_prompt - num_cached_tokens
    always = rule.mode == "always"
    if not always and effective < rule.min_tokens:
        return Decision(None, f"effective prompt {effective} < {rule.min_tokens} tokens")
    if not always and num_cached_tokens > rule.max_cached_fraction * num_prompt:
        return Decision(None, f"{num_cached_tokens} of {num_prompt} tokens cached here")
    block_size = max(1, prefill_engines[0].block_size) if prefill_engines else 1
    room = [h for h in prefill_engines
            if h.num_queued_tokens <= rule.max_queued_tokens
            and (h.num_free_blocks + h.num_evictable_blocks) * block_size >= num_prompt]
    if not room:
        return Decision(None, "no prefill engine with room" if prefill_engines
                        else "no prefill engine", weighed=True)
    engine = min(room, key=lambda h: (h.num_queued_tokens, h.num_running, h.instance_id))
    if always:
        return Decision(engine, "always")
    local = local_prefill_seconds(model, decodes, num_cached_tokens, effective, token_budget,
                                  max_step_seconds)
    there = prefill_seconds(model, 0, engine.num_queued_tokens, token_budget)
    remote_prefill = prefill_seconds(model, 0, num_prompt, token_budget)  # none of it cached
    if local is None or there is None or remote_prefill is None:
        return (Decision(engine, "decodes would stall (no step times yet)") if decodes.rows
                else Decision(None, "idle here (no step times yet)", weighed=True))
    transfer = effective * rule.kv_bytes_per_token / rule.bytes_per_second
    remote = there + remote_prefill + transfer + rule.handover_seconds
    if remote >= local:
        return Decision(None, f"predicted first token here {local:.3f} s <= there "
                              f"{remote:.3f} s", weighed=True)
    return Decision(engine, f"predicted first token there {remote:.3f} s < here {local:.3f} s")


def prefill_seconds(model: StepTimeModel, start: int, num_tokens: int,
                    token_budget: int) -> float | None:
    """A prefill alone on an engine: chunks of the whole token budget."""
    total, position, end = 0.0, start, start + num_tokens
    while position < end:
        chunk = min(token_budget, end - position)
        seconds = model.predict(StepShape().plus(position, chunk))
        if seconds is None:
            return None
        total, position = total + seconds, position + chunk
    return total


def local_prefill_seconds(model: StepTimeModel, decodes: StepShape, start: int,
                          num_tokens: int, token_budget: int,
                          max_step_seconds: float) -> float | None:
    """The same prefill here, beside these decodes: chunks as the scheduler would size them."""
    if not decodes.rows:
        return prefill_seconds(model, start, num_tokens, token_budget)
    total, position, end = 0.0, start, start + num_tokens
    for _ in range(MAX_SIMULATED_STEPS):
        if position >= end:
            return total
        budget = StepBudget(model, StepShape(decodes.rows, decodes.tokens, decodes.kilo_keys),
                            max_step_seconds)
        chunk = max(1, budget.prompt_chunk(position, min(token_budget, end - position)))
        seconds = model.predict(decodes.plus(position, chunk))
        if seconds is None:
            return None
        total, position = total + seconds, position + chunk
    return total * (end - start) / max(position - start, 1)  # the rest at the same pace

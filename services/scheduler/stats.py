"""What an engine says of itself: its heartbeat (its load, which the router and the decode
engines weigh) and its stats (EngineStats: what it did since it started, for /metrics and the
benchmarks). Pure: read off the scheduler's books; the service sends them."""

from __future__ import annotations

from llmbus.bus.messages import EngineStats, Heartbeat
from llmbus.services.scheduler.scheduler import Scheduler


def heartbeat(scheduler: Scheduler, instance_id: str, adapters: list[str] | None = None
              ) -> Heartbeat:
    """`adapters`: the LoRA adapters its executor holds (for routers to prefer)."""
    s, config = scheduler, scheduler.config
    return Heartbeat(
        service="scheduler", instance_id=instance_id, engine_id=config.engine_id,
        num_running=len(s.running), num_waiting=len(s.waiting) + len(s.remote),
        num_free_blocks=s.kv.num_free, num_total_blocks=s.kv.num_usable,
        block_size=config.block_size, num_handled=s.counters.num_finished,
        role=config.role, num_queued_tokens=s.num_uncomputed_tokens,
        num_evictable_blocks=s.kv.num_evictable(), adapters=adapters or [])


def engine_stats(scheduler: Scheduler, busy_seconds: float, idle_seconds: float) -> EngineStats:
    """The scheduler's numbers, and its executor's busy and idle time (engine_loop.py). What
    only the remote prefill's bus side counts (bytes and seconds moved) is 0 here."""
    s, counters = scheduler, scheduler.counters
    return EngineStats(
        engine_id=s.config.engine_id, num_steps=s.num_steps, num_running=len(s.running),
        num_waiting=len(s.waiting), num_free_blocks=s.kv.num_free,
        num_total_blocks=s.kv.num_usable, max_batch_size=counters.max_batch_size,
        num_preemptions=counters.num_preemptions, num_finished=counters.num_finished,
        num_cached_blocks=s.kv.num_cached,
        num_prefix_query_tokens=counters.num_prefix_query_tokens,
        num_prefix_hit_tokens=counters.num_prefix_hit_tokens,
        executor_busy_seconds=busy_seconds, executor_idle_seconds=idle_seconds,
        num_evictable_blocks=s.kv.num_evictable(),
        num_draft_tokens=counters.num_draft_tokens,
        num_accepted_tokens=counters.num_accepted_tokens,
        num_remote_prefills=counters.num_remote_prefills,
        num_remote_fallbacks=counters.num_remote_fallbacks,
        num_prefill_engines=len(s.remote.prefill_engines),
        num_generated_tokens=counters.num_generated_tokens)

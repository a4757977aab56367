"""The api's commands to the engines about LoRA adapters: `AdapterCommand` on
EXECUTOR_ADAPTERS, which every executor receives (no queue group) and answers with one
AdapterReply per engine; the api waits for the engines alive when it sends (their executors'
heartbeats), up to a timeout."""

from __future__ import annotations

from llmbus.bus import subjects
from llmbus.bus.messages import AdapterCommand, AdapterReply
from llmbus.services.api.stats_bus import PipelineStats


async def command_engines(stats: PipelineStats, name: str, action: str,
                          timeout: float) -> tuple[set[str], list[AdapterReply]]:
    """Tell every executor to `load` or `unload` the adapter `name`: the engines alive when it
    was sent, and the replies that came from them (and any other) until each had answered,
    or `timeout` seconds passed."""
    engine_ids = stats.live_engine_ids()
    if not engine_ids:
        return engine_ids, []

    def all_answered(replies: list[AdapterReply]) -> bool:
        return engine_ids <= {r.engine_id for r in replies}

    replies = await stats.runtime.gather(
        subjects.EXECUTOR_ADAPTERS, AdapterCommand(name=name, action=action), AdapterReply,
        expected=1, timeout=timeout, done=all_answered)
    return engine_ids, replies

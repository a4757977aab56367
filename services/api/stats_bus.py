"""What the api knows of the pipeline's copies, over the bus: who is alive (every copy's
heartbeats), who is ready (a ping to each stage, for /health), and the counters of every engine
and every api copy (one scatter-gather each, for /metrics and the pipeline page).

The liveness tables are also what migration_bus.py judges engines and detokenizers by.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import (
    ApiMetricsRequest,
    ApiMetricsSnapshot,
    EngineStats,
    EngineStatsRequest,
    Heartbeat,
    Ping,
    Pong,
)
from llmbus.bus.runtime import ServiceRuntime

PIPELINE_STAGES = ("tokenizer", "scheduler", "executor", "detokenizer")


class PipelineStats:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.copies = {stage: Liveness() for stage in (*PIPELINE_STAGES, "api")}
        # A copy whose bus connection came back (its num_reconnects grew): what it sent
        # meanwhile may be lost (migration_bus.py recovers the requests it held).
        self.on_copy_reconnected: Callable[[Heartbeat], object] = lambda _: None
        self._health: tuple[float, dict[str, bool]] = (0.0, {})

    async def start(self) -> None:
        for stage in self.copies:
            await self.runtime.on_message(subjects.heartbeat(stage), Heartbeat,
                                          self._on_heartbeat)
        self.runtime.on_reconnect(self._on_reconnect)

    async def _on_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        liveness = self.copies[heartbeat.service]
        before = liveness.latest.get(heartbeat.instance_id)
        liveness.seen(heartbeat, time.monotonic())
        if before is not None and heartbeat.num_reconnects > before.num_reconnects:
            self.on_copy_reconnected(heartbeat)

    async def _on_reconnect(self) -> None:
        """Back on the bus: the others were silent only to us meanwhile."""
        now = time.monotonic()
        for liveness in self.copies.values():
            liveness.pardon(now)

    def num_copies(self) -> dict[str, int]:
        now = self.runtime.bus_time()
        return {stage: len(liveness.alive(now)) for stage, liveness in self.copies.items()}

    def live_copies(self) -> dict[str, list[tuple[Heartbeat, float]]]:
        """Each stage's live copies, with the seconds since each one's last heartbeat."""
        alive_at, now = self.runtime.bus_time(), time.monotonic()
        return {stage: [(h, now - liveness.last_seen[h.instance_id])
                        for h in liveness.alive(alive_at)]
                for stage, liveness in self.copies.items()}

    def live_engine_ids(self) -> set[str]:
        """The engines whose executors sent heartbeats lately (each once, however many layer
        shards it has)."""
        return {h.engine_id for h in self.copies["executor"].alive(self.runtime.bus_time())
                if h.engine_id}

    async def stage_health(self) -> dict[str, bool]:
        """Ready state of every pipeline stage (cached for a second)."""
        checked_at, health = self._health
        if time.monotonic() - checked_at < 1.0:
            return health

        async def ready(stage: str) -> bool:
            try:
                pong = await self.runtime.request(subjects.ping(stage), Ping(), Pong, timeout=1.0)
                return pong.ready
            except Exception:
                return False

        results = await asyncio.gather(*(ready(stage) for stage in PIPELINE_STAGES))
        health = dict(zip(PIPELINE_STAGES, results, strict=True))
        self._health = (time.monotonic(), health)
        return health

    async def engine_stats(self, timeout: float = 0.25) -> list[EngineStats]:
        """Counters of every engine: one request, every scheduler answers (scatter-gather);
        done once every engine heard of lately has, else at `timeout`."""
        expected = max(len(self.copies["scheduler"].alive(self.runtime.bus_time())), 1)
        replies = await self.runtime.gather(subjects.ENGINE_STATS, EngineStatsRequest(),
                                            EngineStats, expected=expected, timeout=timeout)
        return sorted(replies, key=lambda s: s.engine_id)

    async def api_metrics(self, timeout: float = 0.25) -> list[ApiMetricsSnapshot]:
        """Request metrics of every api copy, this one included (they share the port, so a
        scrape reaches any one of them)."""
        expected = max(len(self.copies["api"].alive(self.runtime.bus_time())), 1)
        replies = await self.runtime.gather(subjects.API_METRICS, ApiMetricsRequest(),
                                            ApiMetricsSnapshot, expected=expected,
                                            timeout=timeout)
        return sorted(replies, key=lambda s: s.replica)

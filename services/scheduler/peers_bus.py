"""What an engine hears of the copies it depends on, by their heartbeats (bus/liveness.py):

- its executor: silent, and the step in flight fails (the engine loop asks `executor_silent`);
  reconnected to the bus, and the results of its steps may be lost, so every request held
  ends with a resumable error;
- detokenizer copies: one gone, and its completions move to another (detokenizer_routing.py);
  one that lost a completion's start (UnknownCompletion) has it end with a resumable error;
- api copies: one gone, and its requests are aborted (no client is left to read them).

And the engine's own reconnects: step results and token batches of the gap may be lost, so
every request held ends with a resumable error (the api resumes them, here or elsewhere).
"""

from __future__ import annotations

import time

import structlog
from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import Heartbeat, TokenBatch, UnknownCompletion
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.scheduler.detokenizer_routing import DetokenizerRouting
from llmbus.services.scheduler.engine_loop import EngineLoop
from llmbus.services.scheduler.scheduler import Scheduler

log = structlog.get_logger()


class Peers:
    def __init__(self, runtime: ServiceRuntime, engine_id: str,
                 detokenizers: DetokenizerRouting) -> None:
        self.runtime, self.engine_id, self.detokenizers = runtime, engine_id, detokenizers
        self.apis = Liveness()
        self.executor = Liveness()
        self._executor_reconnects: dict[str, int] = {}  # by executor instance
        self.executor_adapters: list[str] = []  # the LoRA adapters it holds
        self.scheduler: Scheduler | None = None
        self.loop: EngineLoop | None = None

    async def start(self, scheduler: Scheduler, loop: EngineLoop) -> None:
        self.scheduler, self.loop = scheduler, loop
        self.runtime.on_reconnect(self.on_reconnect)
        await self.runtime.on_message(subjects.heartbeat("detokenizer"), Heartbeat,
                                      self.on_detokenizer_heartbeat)
        await self.runtime.on_message(subjects.heartbeat("api"), Heartbeat,
                                      self.on_api_heartbeat)
        await self.runtime.on_message(subjects.heartbeat("executor"), Heartbeat,
                                      self.on_executor_heartbeat)
        await self.runtime.on_message(subjects.engine_unknown_completion(self.engine_id),
                                      UnknownCompletion, self.on_unknown_completion)

    def executor_found(self) -> None:
        """Its info reply counts as heard from: an executor killed before its first heartbeat
        reached us (they start as it is ready, and this subscription may miss the first) is
        then taken for dead DEAD_AFTER later, instead of never (a step held forever)."""
        self.executor.seen(Heartbeat(service="executor", instance_id="(info reply)",
                                     engine_id=self.engine_id), time.monotonic())

    def executor_silent(self) -> bool:
        """Heard from our executor before, but not lately (it died mid-step)."""
        return bool(self.executor.last_seen) and not self.executor.alive(self.runtime.bus_time())

    async def on_detokenizer_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        self.detokenizers.liveness.seen(heartbeat, time.monotonic())
        for dead in self.detokenizers.liveness.reap(self.runtime.bus_time()):
            log.warning("detokenizer gone; its requests move", instance=dead.instance_id)

    async def on_unknown_completion(self, report: UnknownCompletion, _: Msg) -> None:
        """A detokenizer copy cannot decode a completion (it never got its start): end it with
        an error, which goes to that copy with the start, so its client is told."""
        assert self.scheduler is not None and self.loop is not None
        key = (report.request_id, report.index)
        error = (f"detokenizer {report.instance_id} never got this completion's start (a "
                 "message was lost), so it cannot decode its text")
        log.warning("detokenizer lost a completion", request_id=report.request_id,
                    index=report.index, instance=report.instance_id)
        if self.detokenizers.lost(key, report.instance_id):
            if self.scheduler.abort_request(report.request_id, report.index, error=error,
                                            resumable=True):
                self.loop.wakeup.set()
            return
        ended = self.detokenizers.ended_error(key, report.instance_id, error)
        if ended is not None:  # it ended meanwhile: tell its client there and then
            subject, update = ended
            await self.runtime.publish(subject, TokenBatch(engine_id=self.engine_id,
                                                           items=[update]))

    async def on_api_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        self.apis.seen(heartbeat, time.monotonic())
        for dead in self.apis.reap(self.runtime.bus_time()):
            assert self.scheduler is not None and self.loop is not None
            num = self.scheduler.abort_for_reply_subject(subjects.api_deltas(dead.instance_id))
            log.warning("api copy gone; its requests aborted", instance=dead.instance_id,
                        num_requests=num)
            self.loop.wakeup.set()

    async def on_executor_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        if heartbeat.engine_id != self.engine_id or heartbeat.shard:  # the lead answers
            return
        self.executor.seen(heartbeat, time.monotonic())
        self.executor_adapters = heartbeat.adapters  # the engine's heartbeat passes them on
        before = self._executor_reconnects.get(heartbeat.instance_id, heartbeat.num_reconnects)
        self._executor_reconnects[heartbeat.instance_id] = heartbeat.num_reconnects
        if heartbeat.num_reconnects > before and self.loop is not None:
            log.warning("executor reconnected: its step results may be lost")
            self.loop.interrupt(f"engine {self.engine_id}'s executor lost its bus connection")

    async def on_reconnect(self) -> None:
        """Back on the bus: every request held ends with a resumable error; the copies watched
        were silent only to us."""
        now = time.monotonic()
        for liveness in (self.apis, self.executor, self.detokenizers.liveness):
            liveness.pardon(now)
        assert self.loop is not None
        self.loop.interrupt(f"engine {self.engine_id} lost its bus connection")

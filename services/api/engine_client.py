"""The api's side of the bus: submit requests, receive their text deltas, abort them.

Each api copy subscribes to its own deltas subject (`reply_subject` in every request), so the
detokenizer sends a client's text straight to the copy that holds the client's connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.liveness import HEARTBEAT_INTERVAL, Liveness
from llmbus.bus.messages import (
    AbortRequest,
    Admission,
    ApiMetricsRequest,
    ApiMetricsSnapshot,
    DecodeRequest,
    DecodeResult,
    DeltaBatch,
    EncodeRequest,
    EncodeResult,
    EngineStats,
    EngineStatsRequest,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    Heartbeat,
    ModelInfo,
    ModelInfoRequest,
    Ping,
    Pong,
    TextDelta,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.api.errors import OpenAIError

log = structlog.get_logger()

R = TypeVar("R", bound=msgspec.Struct)


@dataclass
class _Placement:
    scheduler_instance_id: str  # the scheduler process holding the request
    request: GenerateRequest  # kept to move it if that engine dies before any output
    queue: asyncio.Queue
    got_output: bool = False


PIPELINE_STAGES = ("tokenizer", "scheduler", "executor", "detokenizer")


class EngineClient:
    def __init__(self, runtime: ServiceRuntime, request_timeout: float) -> None:
        self.runtime = runtime
        self.request_timeout = request_timeout
        self.reply_subject = subjects.api_deltas(runtime.instance_id)
        self._streams: dict[str, asyncio.Queue[TextDelta]] = {}
        # Where each request runs, to notice when its engine dies: request id -> placement.
        self._placements: dict[str, _Placement] = {}
        self._model: ModelInfo | None = None
        self._health: tuple[float, dict[str, bool]] = (0.0, {})
        self.copies = {stage: Liveness() for stage in (*PIPELINE_STAGES, "api")}
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> None:
        await self.runtime.on_message(self.reply_subject, DeltaBatch, self._on_deltas)
        for stage in self.copies:
            await self.runtime.on_message(subjects.heartbeat(stage), Heartbeat,
                                          self._on_heartbeat)
        self._watchdog = asyncio.create_task(self._watch_engines())

    async def _on_deltas(self, batch: DeltaBatch, _: Msg) -> None:
        for delta in batch.items:
            queue = self._streams.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
                placement = self._placements.get(delta.request_id)
                if placement is not None:
                    placement.got_output = True

    async def _on_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        self.copies[heartbeat.service].seen(heartbeat, time.monotonic())

    def num_copies(self) -> dict[str, int]:
        now = time.monotonic()
        return {stage: len(liveness.alive(now)) for stage, liveness in self.copies.items()}

    async def _watch_engines(self) -> None:
        """When an engine falls silent, its requests move to another engine if nothing was
        sent to their clients yet, and end with an explicit error otherwise."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            now = time.monotonic()
            dead = {h.instance_id for h in self.copies["scheduler"].reap(now)}
            # Every detokenizer copy gone: no text can reach any client until one is back.
            detokenizers = self.copies["detokenizer"]
            no_detokenizer = bool(detokenizers.last_seen) and not detokenizers.alive(now)
            for request_id, placement in list(self._placements.items()):
                if no_detokenizer:
                    self._placements.pop(request_id, None)
                    placement.queue.put_nowait(TextDelta(
                        request_id=request_id, text="", finish_reason=FinishReason.ERROR,
                        error="no detokenizer is running"))
                    continue
                if placement.scheduler_instance_id not in dead:
                    continue
                log.warning("engine gone", request_id=request_id,
                            scheduler=placement.scheduler_instance_id)
                if not placement.got_output:
                    try:
                        await self._admit(placement.request, placement.queue)
                        log.info("request moved to another engine", request_id=request_id)
                        continue
                    except OpenAIError as exc:
                        reason = f"its engine stopped and no other took it: {exc.message}"
                else:
                    reason = "its engine stopped responding"
                self._placements.pop(request_id, None)
                placement.queue.put_nowait(TextDelta(
                    request_id=request_id, text="", finish_reason=FinishReason.ERROR,
                    error=reason))

    async def model_info(self) -> ModelInfo:
        if self._model is None:
            try:
                self._model = await self.runtime.request(
                    subjects.ENGINE_MODEL, ModelInfoRequest(), ModelInfo, timeout=2.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                raise OpenAIError(503, "no engine is ready yet; retry shortly",
                                  headers={"Retry-After": "1"}) from None
        return self._model

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
        expected = max(len(self.copies["scheduler"].alive(time.monotonic())), 1)
        replies = await self.runtime.gather(subjects.ENGINE_STATS, EngineStatsRequest(),
                                            EngineStats, expected=expected, timeout=timeout)
        return sorted(replies, key=lambda s: s.engine_id)

    async def api_metrics(self, timeout: float = 0.25) -> list[ApiMetricsSnapshot]:
        """Request metrics of every api copy, this one included (they share the port, so a
        scrape reaches any one of them)."""
        expected = max(len(self.copies["api"].alive(time.monotonic())), 1)
        replies = await self.runtime.gather(subjects.API_METRICS, ApiMetricsRequest(),
                                            ApiMetricsSnapshot, expected=expected,
                                            timeout=timeout)
        return sorted(replies, key=lambda s: s.replica)

    async def submit(self, request: GenerateRequest, queue: asyncio.Queue) -> Admission:
        """Send a request into the pipeline, its deltas to `queue`; raises OpenAIError when
        it is refused. Several requests may share one queue (batched prompts)."""
        self._streams[request.request_id] = queue  # before sending: deltas may come fast
        return await self._admit(request, queue)

    async def _admit(self, request: GenerateRequest, queue: asyncio.Queue) -> Admission:
        try:
            # Tokenizing and admission take milliseconds; 8 s means the tokenizer copy died.
            admission = await self.runtime.request(subjects.TOKENIZER_GENERATE, request,
                                                   Admission, timeout=8.0)
        except nats.errors.NoRespondersError:
            self._streams.pop(request.request_id, None)
            raise OpenAIError(503, "the tokenizer stage is not available; retry shortly",
                              headers={"Retry-After": "1"}) from None
        except nats.errors.TimeoutError:
            self._streams.pop(request.request_id, None)
            await self.abort(request.request_id)
            raise OpenAIError(503, "the pipeline did not admit the request in time",
                              headers={"Retry-After": "1"}) from None
        if admission.error_code:
            self._streams.pop(request.request_id, None)
            status = {ErrorCode.OVERLOADED: 503, ErrorCode.INTERNAL: 500}.get(
                ErrorCode(admission.error_code), 400)
            code = ("context_length_exceeded"
                    if admission.error_code == ErrorCode.CONTEXT_LENGTH_EXCEEDED else None)
            raise OpenAIError(status, admission.error_message, param=admission.error_param,
                              code=code, headers={"Retry-After": "1"} if status == 503 else None)
        self._placements[request.request_id] = _Placement(admission.scheduler_instance_id,
                                                          request, queue)
        return admission

    async def deltas(self, queue: asyncio.Queue, num_choices: int,
                     ) -> AsyncIterator[TextDelta]:
        """Yield deltas until `num_choices` completions finished; an error delta on silence.

        The caller must call `release` when done (finished, failed or the client left).
        """
        num_finished = 0
        while num_finished < num_choices:
            try:
                delta = await asyncio.wait_for(queue.get(), timeout=self.request_timeout)
            except TimeoutError:
                yield TextDelta(request_id="", text="", finish_reason=FinishReason.ERROR,
                                error=f"no progress for {self.request_timeout:.0f} s")
                return
            yield delta
            if delta.finish_reason != FinishReason.NONE:
                num_finished += 1

    async def release(self, request_ids: list[str], finished: bool) -> None:
        """Forget requests; if they did not finish (client gone), abort them in the pipeline."""
        for request_id in request_ids:
            self._placements.pop(request_id, None)
            if self._streams.pop(request_id, None) is not None and not finished:
                await self.abort(request_id)

    async def encode(self, request: EncodeRequest) -> list[int]:
        result = await self._tokenizer_call(subjects.TOKENIZER_ENCODE, request, EncodeResult)
        if result.error_message:
            raise OpenAIError(400, result.error_message,
                              param="messages" if request.messages else "prompt")
        return result.token_ids

    async def decode(self, token_ids: list[int]) -> str:
        result = await self._tokenizer_call(subjects.TOKENIZER_DECODE,
                                            DecodeRequest(token_ids), DecodeResult)
        if result.error_message:
            raise OpenAIError(400, result.error_message, param="tokens")
        return result.text

    async def _tokenizer_call(self, subject: str, request: msgspec.Struct,
                              reply_type: type[R]) -> R:
        try:
            return await self.runtime.request(subject, request, reply_type, timeout=10.0)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            raise OpenAIError(503, "the tokenizer stage is not available; retry shortly",
                              headers={"Retry-After": "1"}) from None

    async def abort(self, request_id: str) -> None:
        try:
            await self.runtime.publish(subjects.SCHEDULER_ABORT, AbortRequest(request_id))
            log.info("abort sent", request_id=request_id)
        except Exception as exc:  # the bus is gone; nothing left to free
            log.warning("abort failed", request_id=request_id, error=str(exc))

# Over 300 lines: every exchange of the api with the pipeline, and the migration of requests
# that rides on them (the pure rules are migration.py's).
"""The api's side of the bus: submit requests, receive their text deltas, abort them, and move
them to another engine when theirs fails or the bus loses their messages (migration.py).

Each api copy subscribes to its own deltas subject (`reply_subject` in every request), so the
detokenizer sends a client's text straight to the copy that holds the client's connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

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
from llmbus.services.api.migration import DEFAULT_MIGRATION_LIMIT, Placement, Verdict

log = structlog.get_logger()

R = TypeVar("R", bound=msgspec.Struct)


RESUME_PATIENCE = 3.0  # seconds a resumed request may wait for an engine to take it
PIPELINE_STAGES = ("tokenizer", "scheduler", "executor", "detokenizer")


class EngineClient:
    def __init__(self, runtime: ServiceRuntime, request_timeout: float,
                 migration_limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        self.runtime = runtime
        self.request_timeout = request_timeout
        self.migration_limit = migration_limit
        self.on_migrated: Callable[[], object] = lambda: None  # the metrics' counter
        self.reply_subject = subjects.api_deltas(runtime.instance_id)
        self._streams: dict[str, asyncio.Queue[TextDelta]] = {}
        # Each request in flight: where it runs and what its client has (migration.py).
        self._placements: dict[str, Placement] = {}
        self._tasks: set[asyncio.Task] = set()  # migrations and aborts under way
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
        self.runtime.on_reconnect(self._on_reconnect)

    async def _on_deltas(self, batch: DeltaBatch, _: Msg) -> None:
        for delta in batch.items:
            placement = self._placements.get(delta.request_id)
            if placement is None:
                continue  # it ended (or its client left)
            verdict = placement.judge(delta)
            if verdict is Verdict.FORWARD:
                placement.queue.put_nowait(delta)
            elif verdict is Verdict.STALE and delta.attempt not in placement.aborted_attempts:
                placement.aborted_attempts.add(delta.attempt)  # a partitioned engine is back
                self._spawn(self.runtime.publish(subjects.SCHEDULER_ABORT, AbortRequest(
                    delta.request_id, up_to_attempt=delta.attempt)))
            elif verdict is Verdict.RESUME:
                self._migrate(placement, delta.error or
                              f"tokens {len(placement.received.get(delta.index, []))}+ of "
                              "its stream were lost on the bus")

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _migrate(self, placement: Placement, reason: str, avoid_instance_id: str = "") -> None:
        """Resume the request as its next attempt on an engine (another one than
        `avoid_instance_id` if any is alive), or end it with an explicit error once it has
        moved `migration_limit` times or no engine takes it."""
        if not placement.unfinished():  # it ended; its client is still reading it
            return
        if placement.moving:  # the new attempt failed before its admission came back
            placement.failed_meanwhile = reason
            return
        placement.moving = True
        self._spawn(self._resume(placement, reason, avoid_instance_id))

    async def _resume(self, placement: Placement, reason: str, avoid_instance_id: str) -> None:
        request_id = placement.request.request_id
        if placement.attempt >= self.migration_limit:
            log.warning("migration limit reached", request_id=request_id, reason=reason)
            placement.end_with_error(f"{reason}; gave up after {placement.attempt} "
                                     "migrations (--migration-limit)")
            self._placements.pop(request_id, None)
            return
        old = placement.attempt
        request = placement.next_attempt(avoid_instance_id)
        placement.aborted_attempts.add(old)
        try:
            await self.runtime.publish(subjects.SCHEDULER_ABORT,
                                       AbortRequest(request_id, up_to_attempt=old))
            admission = await self._admit_soon(request)
        except Exception as exc:
            placement.moving = False
            if placement.failed_meanwhile or not self.runtime.connected:
                # This copy's bus dropped meanwhile: its reconnect resumes the request again
                # (or already asked to, below).
                self._move_again(placement)
                return
            why = exc.message if isinstance(exc, OpenAIError) else str(exc) or repr(exc)
            placement.end_with_error(f"{reason}, and no engine could resume it: {why}")
            self._placements.pop(request_id, None)
            return
        if self._placements.get(request_id) is not placement:  # its client left meanwhile
            await self.abort(request_id)
            return
        placement.scheduler_instance_id = admission.scheduler_instance_id
        placement.scheduler_reconnects = admission.scheduler_reconnects
        placement.moving = False
        self.on_migrated()
        log.info("request migrated", request_id=request_id, attempt=placement.attempt,
                 reason=reason, scheduler=admission.scheduler_instance_id,
                 resumed_tokens=[len(c.output_token_ids) for c in request.resumed])
        self._move_again(placement)

    async def _admit_soon(self, request: GenerateRequest) -> Admission:
        """Admit a resumed request, retrying for a few seconds while no engine takes it (503):
        after a bus outage the stages reconnect one by one, and this copy may be first."""
        deadline = time.monotonic() + RESUME_PATIENCE
        while True:
            try:
                return await self._admit(request)
            except OpenAIError as exc:
                if exc.status_code != 503 or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.5)

    def _move_again(self, placement: Placement) -> None:
        """The attempt just admitted failed before its admission came back: it moves too."""
        if placement.failed_meanwhile:
            reason, placement.failed_meanwhile = placement.failed_meanwhile, ""
            self._migrate(placement, reason)

    async def _on_reconnect(self) -> None:
        """Back on the bus: deltas sent to this copy meanwhile are lost, and so was its view
        of the others (they were silent only to us). Every request in flight resumes from what
        its client has; prefix caching makes that cheap where it lands on the same engine."""
        now = time.monotonic()
        for liveness in self.copies.values():
            liveness.pardon(now)
        for placement in list(self._placements.values()):
            self._migrate(placement, "the api lost its bus connection")

    async def _on_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        liveness = self.copies[heartbeat.service]
        before = liveness.latest.get(heartbeat.instance_id)
        liveness.seen(heartbeat, time.monotonic())
        if before is not None and heartbeat.num_reconnects > before.num_reconnects:
            self._recover_from(heartbeat)

    def _recover_from(self, copy: Heartbeat) -> None:
        """An engine reconnected: what it sent while its connection was down may be lost (a
        request's last tokens, its end, which no gap would show), so the requests it held
        from before resume. (A detokenizer copy ends those it holds itself, on_reconnect.)"""
        if copy.service != "scheduler":
            return
        for placement in list(self._placements.values()):
            if (placement.scheduler_instance_id == copy.instance_id
                    and placement.scheduler_reconnects < copy.num_reconnects):
                self._migrate(placement, f"engine {copy.engine_id} lost its bus connection")

    def num_copies(self) -> dict[str, int]:
        now = self.runtime.bus_time()
        return {stage: len(liveness.alive(now)) for stage, liveness in self.copies.items()}

    def live_copies(self) -> dict[str, list[tuple[Heartbeat, float]]]:
        """Each stage's live copies, with the seconds since each one's last heartbeat."""
        alive_at, now = self.runtime.bus_time(), time.monotonic()
        return {stage: [(h, now - liveness.last_seen[h.instance_id])
                        for h in liveness.alive(alive_at)]
                for stage, liveness in self.copies.items()}

    async def _watch_engines(self) -> None:
        """When an engine falls silent, its requests resume on another engine (migration).
        Nothing is judged while this copy is off the bus: the silence is ours."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            if not self.runtime.connected:
                continue
            now = self.runtime.bus_time()
            dead = {h.instance_id: h for h in self.copies["scheduler"].reap(now)}
            # Every detokenizer copy gone: no text can reach any client until one is back.
            detokenizers = self.copies["detokenizer"]
            no_detokenizer = bool(detokenizers.last_seen) and not detokenizers.alive(now)
            if no_detokenizer:
                for request_id, placement in list(self._placements.items()):
                    self._placements.pop(request_id, None)
                    placement.end_with_error(
                        f"no detokenizer copy is alive (none heard from for "
                        f"{detokenizers.dead_after:g} s)")
                continue
            # A dead copy took with it the text it held, and tokens sent to it since: its
            # requests resume (those with no text yet may have been its too).
            lost_copies = {h.instance_id for h in detokenizers.reap(now)}
            for request_id, placement in list(self._placements.items()):
                gone = dead.get(placement.scheduler_instance_id)
                if gone is not None:
                    log.warning("engine gone", request_id=request_id, engine=gone.engine_id)
                    self._migrate(placement, f"engine {gone.engine_id} stopped answering",
                                  avoid_instance_id=gone.instance_id)
                elif lost_copies and placement.decoded_by(lost_copies):
                    self._migrate(placement, f"detokenizer {', '.join(sorted(lost_copies))} "
                                  "stopped answering")

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

    async def submit(self, request: GenerateRequest, queue: asyncio.Queue) -> Admission:
        """Send a request into the pipeline, its deltas to `queue`; raises OpenAIError when
        it is refused. Several requests may share one queue (batched prompts)."""
        # Before sending: deltas may come before the admission does.
        self._streams[request.request_id] = queue
        placement = self._placements[request.request_id] = Placement(request, queue)
        try:
            admission = await self._admit(request)
        except OpenAIError:
            self._streams.pop(request.request_id, None)
            self._placements.pop(request.request_id, None)
            raise
        if placement.attempt == request.attempt:  # else a migration moved it meanwhile
            placement.scheduler_instance_id = admission.scheduler_instance_id
            placement.scheduler_reconnects = admission.scheduler_reconnects
        return admission

    async def _admit(self, request: GenerateRequest) -> Admission:
        try:
            # Tokenizing and admission take milliseconds; 8 s means the tokenizer copy died.
            admission = await self.runtime.request(subjects.TOKENIZER_GENERATE, request,
                                                   Admission, timeout=8.0)
        except nats.errors.NoRespondersError:
            raise OpenAIError(503, "the tokenizer stage is not available; retry shortly",
                              headers={"Retry-After": "1"}) from None
        except nats.errors.TimeoutError:  # that attempt, if an engine takes it late
            await self.abort(request.request_id, up_to_attempt=request.attempt)
            raise OpenAIError(503, "the pipeline did not admit the request in time",
                              headers={"Retry-After": "1"}) from None
        if admission.error_code:
            status = {ErrorCode.OVERLOADED: 503, ErrorCode.INTERNAL: 500}.get(
                ErrorCode(admission.error_code), 400)
            code = ("context_length_exceeded"
                    if admission.error_code == ErrorCode.CONTEXT_LENGTH_EXCEEDED else None)
            raise OpenAIError(status, admission.error_message, param=admission.error_param,
                              code=code, headers={"Retry-After": "1"} if status == 503 else None)
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

    async def abort(self, request_id: str, up_to_attempt: int | None = None) -> None:
        try:
            await self.runtime.publish(subjects.SCHEDULER_ABORT,
                                       AbortRequest(request_id, up_to_attempt=up_to_attempt))
            log.info("abort sent", request_id=request_id)
        except Exception as exc:  # the bus is gone; nothing left to free
            log.warning("abort failed", request_id=request_id, error=str(exc))

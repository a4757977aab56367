"""The api's side of the bus to the pipeline: submit requests, receive their text deltas, abort
them; tokenize and detokenize for the api's own routes; the model's description.

Each api copy subscribes to its own deltas subject (`reply_subject` in every request), so the
detokenizer sends a client's text straight to the copy that holds the client's connection.
What it knows of the pipeline's copies is stats_bus.py's; moving a request to another engine
when theirs fails or the bus loses their messages is migration_bus.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.messages import (
    AbortRequest,
    Admission,
    DecodeRequest,
    DecodeResult,
    DeltaBatch,
    EncodeRequest,
    EncodeResult,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    ModelInfo,
    ModelInfoRequest,
    TextDelta,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.migration import DEFAULT_MIGRATION_LIMIT
from llmbus.services.api.migration_bus import Migrations
from llmbus.services.api.stats_bus import PipelineStats

log = structlog.get_logger()

R = TypeVar("R", bound=msgspec.Struct)


class EngineClient:
    def __init__(self, runtime: ServiceRuntime, request_timeout: float,
                 migration_limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        self.runtime = runtime
        self.request_timeout = request_timeout
        self.reply_subject = subjects.api_deltas(runtime.instance_id)
        self._streams: dict[str, asyncio.Queue[TextDelta]] = {}
        self._model: ModelInfo | None = None
        self._late_aborts: set[asyncio.Task] = set()
        self.stats = PipelineStats(runtime)
        self.migrations = Migrations(runtime, self.stats.copies, self._admit, self.abort,
                                     migration_limit)
        self.stats.on_copy_reconnected = self.migrations.recover_from

    async def start(self) -> None:
        await self.runtime.on_message(self.reply_subject, DeltaBatch, self._on_deltas)
        await self.stats.start()
        self.migrations.start()

    async def _on_deltas(self, batch: DeltaBatch, _: Msg) -> None:
        for delta in batch.items:
            self.migrations.on_delta(delta)

    async def model_info(self) -> ModelInfo:
        if self._model is None:
            try:
                self._model = await self.runtime.request(
                    subjects.ENGINE_MODEL, ModelInfoRequest(), ModelInfo, timeout=2.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                raise OpenAIError(503, "no engine is ready yet; retry shortly",
                                  headers={"Retry-After": "1"}) from None
        return self._model

    async def submit(self, request: GenerateRequest, queue: asyncio.Queue) -> Admission:
        """Send a request into the pipeline, its deltas to `queue`; raises OpenAIError when
        it is refused. Several requests may share one queue (batched prompts)."""
        # Before sending: deltas may come before the admission does.
        self._streams[request.request_id] = queue
        placement = self.migrations.track(request, queue)
        admitting = asyncio.ensure_future(self._admit(placement.request))
        try:
            admission = await asyncio.shield(admitting)
        except asyncio.CancelledError:
            # The client left while the pipeline admits it: an abort sent now could reach the
            # engine before the request does, so one more goes once the admission is back.
            admitting.add_done_callback(self._abort_once_admitted(request.request_id))
            raise
        except OpenAIError:
            self._streams.pop(request.request_id, None)
            self.migrations.forget(request.request_id)
            raise
        self.migrations.admitted(placement, admission)
        return admission

    def _abort_once_admitted(self, request_id: str) -> Callable[[asyncio.Future], None]:
        def done(admitting: asyncio.Future) -> None:
            if not admitting.cancelled() and admitting.exception() is None:
                task = asyncio.ensure_future(self.abort(request_id))
                self._late_aborts.add(task)
                task.add_done_callback(self._late_aborts.discard)
        return done

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
            self.migrations.forget(request_id)
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

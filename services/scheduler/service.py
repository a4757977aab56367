# Over 300 lines: the engine's subjects and their handlers share the scheduler and its loop.
"""The scheduler's bus adapter: its entry point, and the handlers of the engine's subjects.

One engine = one scheduler + its executor. The engine loop (engine_loop.py) plans a step,
sends it to the executor (request/reply here), applies the result and publishes the step's
tokens (here: one message per detokenizer copy). Beside this file, the stage's other modules
that touch NATS are named `*_bus.py`: peers_bus.py watches the copies the engine depends on
(its executor, detokenizer and api copies), grammar_bus.py and adapter_bus.py have a request's
grammar compiled and LoRA adapter fetched before it is admitted, and
disaggregation/remote_prefill_bus.py carries remote prefills.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import nats.errors
import structlog
from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.messages import (
    AbortRequest,
    Admission,
    CacheEvent,
    DeltaBatch,
    EngineStats,
    EngineStatsRequest,
    ErrorCode,
    ExecutorInfo,
    ExecutorInfoRequest,
    Heartbeat,
    ModelInfo,
    ModelInfoRequest,
    RequestTokens,
    StepPlan,
    StepProgress,
    StepResult,
    SubmitRequest,
    TextDelta,
    TokenBatch,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.bus.tracing import current_traceparent
from llmbus.services.scheduler.adapter_bus import AdapterAdmission
from llmbus.services.scheduler.admission import AdmissionError
from llmbus.services.scheduler.config import SchedulerConfig, config_from_args
from llmbus.services.scheduler.config import add_arguments as config_options
from llmbus.services.scheduler.detokenizer_routing import DetokenizerRouting
from llmbus.services.scheduler.disaggregation.remote_prefill_bus import DecodeSide, PrefillSide
from llmbus.services.scheduler.engine_loop import EngineLoop
from llmbus.services.scheduler.grammar_bus import GrammarAdmission
from llmbus.services.scheduler.outputs import embedding_answer
from llmbus.services.scheduler.peers_bus import Peers
from llmbus.services.scheduler.scheduler import Scheduler
from llmbus.services.scheduler.spans import record_request_spans
from llmbus.services.scheduler.stats import engine_stats, heartbeat

log = structlog.get_logger()
# Submits handled at once: a plain one answers at once, a constrained one waits for its grammar
# (up to COMPILE_TIMEOUT), so plain submits must not queue behind it; bounded so that a burst
# of constrained ones waits in the subscription's queue instead of piling up tasks.
MAX_SUBMITS_IN_FLIGHT = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This stage's options: config.py declares them beside SchedulerConfig, which they set."""
    config_options(parser)


class SchedulerService:
    def __init__(self, runtime: ServiceRuntime, config: SchedulerConfig) -> None:
        self.runtime = runtime
        self.config = config  # the KV cache's shape is the executor's: see start()
        self.engine_id = config.engine_id
        self.scheduler: Scheduler | None = None
        self.loop: EngineLoop | None = None
        self.info: ExecutorInfo | None = None
        self.detokenizers = DetokenizerRouting()
        self.peers = Peers(runtime, self.engine_id, self.detokenizers)
        self.grammars = GrammarAdmission(runtime, self.engine_id)
        self.adapters = AdapterAdmission(runtime, self.engine_id, max_adapters=0)  # see start
        self.draining = False  # SIGTERM: finish what is held, take nothing new
        self._next_expiry_check = 0.0
        # Disaggregated serving (disaggregation/remote_prefill_bus.py): one side, by --role
        self.decode_side: DecodeSide | None = None
        self.prefill_side: PrefillSide | None = None

    async def start(self) -> None:
        self.info = await self._wait_for_executor()
        self.scheduler = Scheduler(self.config.with_executor(self.info))
        self.adapters.max_adapters = self.info.max_adapters
        step_subject = subjects.executor_step(self.engine_id)

        async def execute(plan: StepPlan) -> StepResult:
            result = await self.runtime.request(step_subject, plan, StepResult,
                                                timeout=self.config.step_timeout_seconds)
            if self.prefill_side is not None and result.transfers:
                self.prefill_side.on_step_result(result.transfers)
            return result

        self.loop = EngineLoop(self.scheduler, execute=execute, publish=self._publish,
                               expired=self._expired,
                               executor_silent=self.peers.executor_silent,
                               depth=self.config.pipeline_depth, name=f"engine {self.engine_id}")
        await self.peers.start(self.scheduler, self.loop)
        runtime, group = self.runtime, subjects.queue_group("scheduler")
        loop = self.loop  # a multi-step plan's tokens, each forward's as it is sampled
        await runtime.on_message(subjects.executor_progress(self.engine_id), StepProgress,
                                 lambda progress, _: loop.progress(progress))
        if self.info.num_shards > 1 and (self.config.role == "prefill"
                                         or self.config.disaggregation is not None):
            raise SystemExit(f"llmbus scheduler: engine {self.engine_id}'s executor is in "
                             f"{self.info.num_shards} shards, whose KV blocks move to no other "
                             "engine: it can neither prefill for nor decode after another")
        if self.config.role == "prefill":  # the router sends it nothing; decode engines do
            self.prefill_side = PrefillSide(runtime, self.scheduler, self.engine_id,
                                            self.info.layout, self.loop.wakeup,
                                            self._refusal, self.adapters)
            await self.prefill_side.start()
        else:
            await runtime.on_request(subjects.engine_submit(self.engine_id), SubmitRequest,
                                     self.on_submit, concurrency=MAX_SUBMITS_IN_FLIGHT)
            await runtime.on_request(subjects.ENGINE_SUBMIT, SubmitRequest, self.on_submit,
                                     queue=group, concurrency=MAX_SUBMITS_IN_FLIGHT)
        if self.config.disaggregation is not None:
            if self.info.layout is None:
                raise SystemExit(f"llmbus scheduler: engine {self.engine_id}'s executor "
                                 "does not describe its KV layout; it cannot decode for "
                                 "prefill engines")
            self.decode_side = DecodeSide(runtime, self.scheduler.remote, self.engine_id,
                                          self.info.layout, self.loop.wakeup,
                                          self.config.remote_prefill_timeout_seconds)
            await self.decode_side.start()
        await runtime.on_message(subjects.SCHEDULER_ABORT, AbortRequest, self.on_abort)
        await runtime.on_message(subjects.engine_withdraw(self.engine_id), AbortRequest,
                                 self.on_withdraw)
        await runtime.on_request(subjects.ENGINE_MODEL, ModelInfoRequest, self.on_model_info,
                                 queue=group)
        await runtime.on_request(subjects.engine_stats(self.engine_id), EngineStatsRequest,
                                 self.on_stats)
        await runtime.on_request(subjects.ENGINE_STATS, EngineStatsRequest, self.on_stats)
        await runtime.publish(subjects.ENGINE_CACHE_EVENTS, CacheEvent(
            engine_id=self.engine_id, cleared=True, instance_id=runtime.instance_id))
        self.peers.executor_found()
        log.info("executor found", engine_id=self.engine_id, num_blocks=self.info.num_blocks,
                 block_size=self.info.block_size, max_model_len=self.info.max_model_len)

    def heartbeat(self) -> Heartbeat:
        assert self.scheduler is not None
        return heartbeat(self.scheduler, self.runtime.instance_id, self.peers.executor_adapters)

    async def _wait_for_executor(self) -> ExecutorInfo:
        """The executor may still be loading weights: ask until it answers."""
        subject = subjects.executor_info(self.engine_id)
        while not self.runtime.stop_event.is_set():
            try:
                return await self.runtime.request(subject, ExecutorInfoRequest(), ExecutorInfo,
                                                  timeout=2.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.2)
        raise asyncio.CancelledError

    async def on_submit(self, submit: SubmitRequest, _: Msg) -> Admission:
        """Admit a request, or say why not. Submits are handled concurrently: a plain one has
        no await before add_request (so plain ones queue in arrival order); one for an adapter or
        a constraint awaits its executor's preparation (adapter_bus.py, grammar_bus.py), which
        an abort meanwhile refuses."""
        scheduler = self.scheduler
        assert scheduler is not None
        refused = self._refusal(len(submit.prompt_token_ids))
        if refused:
            return Admission(error_code=ErrorCode.OVERLOADED, error_message=refused)
        preparations = [p for needed, p in ((submit.params.adapter, self.adapters.prepare),
                                            (submit.params.structured, self.grammars.compile))
                        if needed]
        for prepare in preparations:  # the executor's, before the request is scheduled
            refusal = await prepare(submit)
            if refusal is not None:
                return refusal
            if self.draining:  # began shutting down meanwhile: another engine may take it
                return Admission(error_code=ErrorCode.OVERLOADED,
                                 error_message="this engine is shutting down; retry shortly")
        try:
            # The engine's own clock: a tokenizer on another host may be skewed, and the queue
            # timeout must not fire (or never fire) because of it.
            self.scheduler.add_request(submit.request_id, submit.reply_subject,
                                       submit.prompt_token_ids, submit.params, time.time(),
                                       n=submit.n, traceparent=current_traceparent(),
                                       attempt=submit.attempt, resumed=submit.resumed)
        except AdmissionError as exc:
            code = (ErrorCode.CONTEXT_LENGTH_EXCEEDED if exc.context_length
                    else ErrorCode.INVALID_REQUEST)
            return Admission(error_code=code, error_message=str(exc), error_param=exc.param)
        self.detokenizers.avoid(submit.request_id, submit.avoid_detokenizer_ids)
        self.loop.wakeup.set()
        return Admission(num_prompt_tokens=len(submit.prompt_token_ids),
                         scheduler_instance_id=self.runtime.instance_id,
                         scheduler_reconnects=self.runtime.num_reconnects)

    def _refusal(self, num_prompt_tokens: int) -> str:
        """Why this engine takes no new request now (another may), or ""."""
        scheduler = self.scheduler
        assert scheduler is not None
        if self.draining:
            return "this engine is shutting down; retry shortly"
        if self.peers.executor_silent():
            return f"engine {self.engine_id}'s executor is not responding"
        if (len(scheduler.waiting) >= self.config.max_queued_requests
                or scheduler.num_queued_tokens + num_prompt_tokens
                > self.config.max_queued_tokens):
            return "the server is busy (its queue is full); retry shortly"
        return ""

    async def on_abort(self, abort: AbortRequest, _: Msg) -> None:
        assert self.scheduler is not None
        if abort.index is None:  # one compiling is refused once it has compiled
            self.grammars.abort(abort.request_id, abort.up_to_attempt)
            self.adapters.abort(abort.request_id, abort.up_to_attempt)
        if self.scheduler.abort_request(abort.request_id, abort.index,
                                        up_to_attempt=abort.up_to_attempt):
            log.info("aborted", request_id=abort.request_id, index=abort.index)
            self.loop.wakeup.set()

    async def on_withdraw(self, withdrawal: AbortRequest, _: Msg) -> None:
        assert self.scheduler is not None
        self.scheduler.withdraw(withdrawal.request_id, withdrawal.up_to_attempt or 0)
        log.info("withdrawn: admitted elsewhere", request_id=withdrawal.request_id)

    async def on_model_info(self, _: ModelInfoRequest, __: Msg) -> ModelInfo:
        assert self.info is not None
        return ModelInfo(model_name=self.info.model_name, max_model_len=self.info.max_model_len,
                         engine_id=self.engine_id)

    async def on_stats(self, _: EngineStatsRequest, __: Msg) -> EngineStats:
        assert self.scheduler is not None and self.loop is not None
        stats = engine_stats(self.scheduler, self.loop.busy_seconds, self.loop.idle_seconds)
        if self.decode_side is not None:
            decode = self.decode_side
            stats.kv_bytes_received, stats.kv_transfer_seconds = decode.kv_bytes, decode.kv_seconds
            stats.handoff_seconds = decode.handoff_seconds
            stats.kv_wait_seconds = decode.kv_wait_seconds
        if self.prefill_side is not None:
            stats.num_prefilled_for_others = self.prefill_side.num_done
        return stats

    def _expired(self, now: float) -> list[RequestTokens]:
        """Requests queued past --queue-timeout; the queue is walked at most once a second,
        not on every step."""
        if now < self._next_expiry_check:
            return []
        self._next_expiry_check = now + 1.0
        assert self.scheduler is not None
        return self.scheduler.expire_waiting(now, self.config.queue_timeout_seconds)

    async def _publish(self, updates: list[RequestTokens], cache_cleared: bool = False) -> None:
        """Send tokens to the detokenizer copies; spans of ended requests; cache events."""
        scheduler = self.scheduler
        assert scheduler is not None
        for request in scheduler.take_finished():
            record_request_spans(request, time.time())
        if self.prefill_side is not None:
            updates = self.prefill_side.divert(updates)
        if self.decode_side is not None:
            self.decode_side.after_step()
        for subject, items in self.detokenizers.route(updates, self.runtime.bus_time()).items():
            await self.runtime.publish(subject, TokenBatch(engine_id=self.engine_id,
                                                           items=items))
        answers: dict[str, list[TextDelta]] = {}  # embedding requests: to their api copies
        for ended in scheduler.take_embedded():
            answers.setdefault(ended.request.reply_subject, []).append(embedding_answer(ended))
        for subject, deltas in answers.items():
            await self.runtime.publish(subject, DeltaBatch(items=deltas))
        if scheduler.kv.tree is not None:
            stored, removed = scheduler.kv.take_events()
            if stored or removed or cache_cleared:
                await self.runtime.publish(subjects.ENGINE_CACHE_EVENTS, CacheEvent(
                    engine_id=self.engine_id, stored=stored, removed=removed,
                    cleared=cache_cleared, instance_id=self.runtime.instance_id))


async def main(args: argparse.Namespace) -> None:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"llmbus scheduler: {exc}") from None
    async with ServiceRuntime("scheduler", args.nats_url, args.instance_id) as runtime:
        service = SchedulerService(runtime, config)
        try:
            await service.start()
            runtime.mark_ready(service.heartbeat)
            await _run_until_stopped(service, config.shutdown_timeout_seconds)
        except asyncio.CancelledError:
            pass
        finally:
            if service.scheduler is not None:  # in-flight requests end explicitly on shutdown
                await service._publish(
                    service.scheduler.fail_all("the scheduler is shutting down"))


async def _run_until_stopped(service: SchedulerService, shutdown_timeout: float) -> None:
    """Run the engine loop until SIGTERM/SIGINT (or its crash), then stop taking requests
    and let the held ones finish for up to `shutdown_timeout` seconds."""
    loop_task = asyncio.create_task(service.loop.run())
    stop_task = asyncio.create_task(service.runtime.stop_event.wait())
    done, _ = await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if loop_task in done:
        loop_task.result()  # surface a crash of the loop
    service.draining = True
    deadline = time.monotonic() + shutdown_timeout
    while service.scheduler.num_held and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    loop_task.cancel()

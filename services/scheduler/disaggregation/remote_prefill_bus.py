"""Disaggregated serving, the scheduler's bus side: both ends of a remote prefill.

A decode engine (`DecodeSide`): the rule (rule.py) picks a prompt and a prefill engine, and
transitions.py holds the request's blocks meanwhile; here its executor opens the transfer into
those blocks (KvReceive), then the prefill engine is asked (PrefillRequest). Its PrefillDone
hands the request to the scheduler with its first token; a refusal, an error, its engine's
death (heartbeats) or a time-out sends the request back to the head of this engine's own queue.

A prefill engine (`PrefillSide`): takes PrefillRequests as requests of one token whose KV its
executor sends to the decode engine (NewRequestData.kv_destination), and answers each with a
PrefillDone once its executor reports the blocks acknowledged (StepResult.transfers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog
from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import (
    AbortRequest,
    FinishReason,
    Heartbeat,
    KvDestination,
    KvLayout,
    KvReceive,
    KvReply,
    KvTransferReport,
    PrefillDone,
    PrefillReply,
    PrefillRequest,
    RequestTokens,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.bus.tracing import current_traceparent
from llmbus.services.scheduler.adapter_bus import AdapterAdmission
from llmbus.services.scheduler.admission import AdmissionError
from llmbus.services.scheduler.disaggregation.transitions import RemotePrefilling
from llmbus.services.scheduler.disaggregation.tries import RemotePrefill
from llmbus.services.scheduler.scheduler import Scheduler

log = structlog.get_logger()
REQUEST_TIMEOUT_SECONDS = 3.0  # for a KvReceive or PrefillRequest answer
REMEMBERED_CANCELS = 4096  # cancels of prefills not here yet, remembered until they come


class DecodeSide:
    def __init__(self, runtime: ServiceRuntime, remote: RemotePrefilling, engine_id: str,
                 layout: KvLayout, wakeup: asyncio.Event, timeout_seconds: float) -> None:
        """`remote`: the scheduler's remote prefills, the only part of it this side moves."""
        self.runtime, self.remote, self.engine_id = runtime, remote, engine_id
        self.layout, self.wakeup, self.timeout_seconds = layout, wakeup, timeout_seconds
        self.prefill_engines = Liveness()
        self.kv_bytes = 0
        self.kv_seconds = 0.0
        self.kv_wait_seconds = 0.0
        self.handoff_seconds = 0.0
        self._refused_layout: set[str] = set()  # prefill instances whose cache differs
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.runtime.on_message(subjects.heartbeat("scheduler"), Heartbeat,
                                      self.on_scheduler_heartbeat)
        await self.runtime.on_message(subjects.engine_prefilled(self.engine_id), PrefillDone,
                                      self.on_prefilled)

    async def on_scheduler_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        now = self.runtime.bus_time()
        if heartbeat.role == "prefill":
            self.prefill_engines.seen(heartbeat, time.monotonic())
        for dead in self.prefill_engines.reap(now):
            for transfer_id in self.remote.tries.on_engine(dead.instance_id):
                self._give_up(transfer_id, f"prefill engine {dead.engine_id} went silent")
        for transfer_id in self.remote.tries.older_than(time.time() - self.timeout_seconds):
            self._give_up(transfer_id, f"no prefill within {self.timeout_seconds:g} s")
        self.remote.prefill_engines = [h for h in self.prefill_engines.alive(now)
                                       if h.instance_id not in self._refused_layout]

    def _give_up(self, transfer_id: str, why: str) -> None:
        if self.remote.failed(transfer_id, time.time()):
            log.warning("remote prefill given up; prefilling here", transfer_id=transfer_id,
                        reason=why)
            self.wakeup.set()

    def after_step(self) -> None:
        """Send the tries the scheduler started, and the cancels of those it gave up."""
        tries = self.remote.tries
        for request, decision in self.remote.take_decisions():
            if decision.engine is not None or decision.weighed:  # not the plain short ones
                log.info("prefill sent to a prefill engine" if decision.engine else
                         "prefill kept here", request_id=request.request_id,
                         num_prompt_tokens=request.num_prompt_tokens, reason=decision.reason,
                         engine=decision.engine.engine_id if decision.engine else None)
        for start in tries.take_starts():
            task = asyncio.create_task(self._start(start))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for cancel in tries.take_cancels():
            task = asyncio.create_task(self.runtime.publish(
                subjects.engine_prefill_cancel(cancel.engine_id),
                AbortRequest(request_id=cancel.transfer_id)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start(self, remote: RemotePrefill) -> None:
        """Open the transfer here, then ask the prefill engine; any refusal or failure:
        prefill here. A try given up meanwhile (aborted) is closed again after its opening,
        which may have reached the executor after the first close, and is not sent."""
        request = remote.request
        block_ids = request.block_table[remote.first_block:]
        destination = KvDestination(transfer_id=remote.transfer_id, engine_id=self.engine_id,
                                    first_block=remote.first_block, block_ids=block_ids)
        try:
            opened = await self.runtime.request(
                subjects.executor_kv_receive(self.engine_id),
                KvReceive(transfer_id=remote.transfer_id, block_ids=block_ids,
                          layout=self.layout), KvReply, timeout=REQUEST_TIMEOUT_SECONDS)
            pending = self.remote.tries.by_transfer
            if remote.transfer_id not in pending:
                self.remote.tries.closed.append(remote.transfer_id)
                self.wakeup.set()
                return
            if opened.error:
                error = f"this engine's executor refused the transfer: {opened.error}"
            else:
                answer = await self.runtime.request(
                    subjects.engine_prefill(remote.engine_id), PrefillRequest(
                        request_id=request.request_id, attempt=request.attempt,
                        prompt_token_ids=request.prompt_token_ids, params=request.params,
                        destination=destination, layout=self.layout,
                        reply_subject=subjects.engine_prefilled(self.engine_id),
                        traceparent=request.trace.traceparent),
                    PrefillReply, timeout=REQUEST_TIMEOUT_SECONDS)
                error = answer.error
                if error.startswith("KV layout mismatch"):  # never again to that engine
                    self._refused_layout.add(remote.instance_id)
                    log.error(error)
                if not error and remote.transfer_id not in pending:  # given up meanwhile:
                    await self.runtime.publish(  # its cancel may have gone out first
                        subjects.engine_prefill_cancel(remote.engine_id),
                        AbortRequest(request_id=remote.transfer_id))
        except Exception as exc:  # gone, slow or broken: this engine prefills it itself
            error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if error:
            self._give_up(remote.transfer_id, error)

    async def on_prefilled(self, done: PrefillDone, _: Msg) -> None:
        if done.error or done.token_id < 0:
            self._give_up(done.transfer_id, done.error or "no token")
            return
        if self.remote.done(done.transfer_id, done.token_id, done.logprobs, time.time(),
                            done.num_bytes):
            self.kv_bytes += done.num_bytes
            self.kv_seconds += done.transfer_seconds
            self.kv_wait_seconds += done.wait_seconds
            self.handoff_seconds += max(0.0, time.time() - done.sampled_at)
            self.wakeup.set()
        # else: a try given up (or a duplicate): its blocks were taken back already


@dataclass
class _Prefilling:
    reply_subject: str
    accepted: float
    report: KvTransferReport | None = None


class PrefillSide:
    def __init__(self, runtime: ServiceRuntime, scheduler: Scheduler, engine_id: str,
                 layout: KvLayout | None, wakeup: asyncio.Event,
                 refuse: Callable[[int], str], adapters: AdapterAdmission | None = None) -> None:
        """`refuse(num_prompt_tokens)`: why this engine takes no prefill now ("" if it does);
        `adapters`: has its executor prepare a prefill's LoRA adapter first."""
        self.runtime, self.scheduler, self.engine_id = runtime, scheduler, engine_id
        self.adapters = adapters or AdapterAdmission(runtime, engine_id, max_adapters=0)
        self.layout, self.wakeup, self.refuse = layout, wakeup, refuse
        self.prefilling: dict[str, _Prefilling] = {}  # by transfer id
        self._cancelled: dict[str, None] = {}  # the latest cancels, oldest first
        self.num_done = 0

    async def start(self) -> None:
        await self.runtime.on_request(subjects.engine_prefill(self.engine_id), PrefillRequest,
                                      self.on_prefill, concurrency=16)
        await self.runtime.on_message(subjects.engine_prefill_cancel(self.engine_id),
                                      AbortRequest, self.on_cancel)

    async def on_prefill(self, request: PrefillRequest, _: Msg) -> PrefillReply:
        mismatch = request.layout.mismatch(self.layout, mine="the decode engine's cache",
                                           theirs=f"prefill engine {self.engine_id}'s")
        if mismatch:
            return PrefillReply(error=mismatch)
        refused = self.refuse(len(request.prompt_token_ids))
        transfer_id = request.destination.transfer_id
        if transfer_id in self._cancelled:  # its cancel overtook it
            refused = "cancelled before it arrived"
        if refused:
            return PrefillReply(error=refused)
        if request.params.adapter:  # its executor fetches it first, as for a submit
            unready = await self.adapters.ready(request.params.adapter)
            if unready is not None:
                return PrefillReply(error=unready.error_message)
        params = msgspec.structs.replace(request.params, max_tokens=1, stop=[],
                                         min_tokens=min(request.params.min_tokens, 1))
        try:
            self.scheduler.add_request(transfer_id, request.reply_subject,
                                       request.prompt_token_ids, params, time.time(),
                                       traceparent=request.traceparent
                                       or current_traceparent(),
                                       kv_destination=request.destination)
        except AdmissionError as exc:
            return PrefillReply(error=str(exc))
        self.prefilling[transfer_id] = _Prefilling(request.reply_subject, time.time())
        self.wakeup.set()
        return PrefillReply()

    async def on_cancel(self, cancel: AbortRequest, _: Msg) -> None:
        if self.scheduler.abort_request(cancel.request_id):
            self.wakeup.set()
            return
        self._cancelled[cancel.request_id] = None  # not here yet: refused when it comes
        while len(self._cancelled) > REMEMBERED_CANCELS:
            del self._cancelled[next(iter(self._cancelled))]

    def on_step_result(self, reports: list[KvTransferReport]) -> None:
        """The executor's transfer reports of a step, before its tokens are applied: a failed
        transfer ends its request (the decode engine refused or is gone)."""
        for report in reports:
            prefilling = self.prefilling.get(report.transfer_id)
            if prefilling is None:
                continue
            prefilling.report = report
            if report.error:
                self.scheduler.abort_request(report.transfer_id,
                                             error=f"KV transfer failed: {report.error}")

    def divert(self, updates: list[RequestTokens]) -> list[RequestTokens]:
        """Take the updates of prefills for other engines out (they become PrefillDone)."""
        kept = []
        for update in updates:
            prefilling = self.prefilling.get(update.request_id)
            if prefilling is None:
                kept.append(update)
                continue
            if update.finish_reason is FinishReason.NONE:
                continue  # cannot be: one token ends it
            del self.prefilling[update.request_id]
            report = prefilling.report or KvTransferReport(transfer_id=update.request_id)
            done = PrefillDone(transfer_id=update.request_id,
                               prefill_seconds=time.time() - prefilling.accepted,
                               num_bytes=report.num_bytes, transfer_seconds=report.seconds,
                               sampled_at=time.time(), wait_seconds=report.wait_seconds)
            if update.error or not update.new_token_ids or update.finish_reason in (
                    FinishReason.ABORT, FinishReason.ERROR):
                done.error = update.error or "the prefill was aborted"
            else:
                self.num_done += 1
                done.token_id = update.new_token_ids[0]
                done.logprobs = update.logprobs[0] if update.logprobs else None
            task = asyncio.create_task(self.runtime.publish(prefilling.reply_subject, done))
            task.add_done_callback(_log_failure)
        return kept


def _log_failure(task: asyncio.Task) -> None:
    """A PrefillDone that could not be sent: the decode engine gives the prefill up when
    this engine's heartbeats or its --remote-prefill-timeout say so."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a prefill's answer could not be sent", error=str(task.exception()))

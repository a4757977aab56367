"""Migration, the bus side: the api's requests in flight, each a `Placement` (migration.py, the
pure rules), and their moves to another engine when theirs fails, falls silent or reconnects,
when their detokenizer dies, or when the bus loses their messages.

A move aborts the old attempt on the bus, then admits the next one (the prompt plus the tokens
already streamed) as a new request through the tokenizer; stale deltas of an old attempt make
that attempt abort again. The judges of silence are the liveness tables of stats_bus.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import structlog

from llmbus.bus import subjects
from llmbus.bus.liveness import HEARTBEAT_INTERVAL, Liveness
from llmbus.bus.messages import AbortRequest, Admission, GenerateRequest, Heartbeat, TextDelta
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.migration import DEFAULT_MIGRATION_LIMIT, Placement, Verdict

log = structlog.get_logger()

RESUME_PATIENCE = 3.0  # seconds a resumed request may wait for an engine to take it, at least
# ... and at most this long while the pipeline is settling: some copy of each stage an admission
# needs still counted alive (their heartbeats may be late while they move to another server),
# or this copy off the bus. With a stage empty, a 503 is for real: no wait beyond the first.
RESUME_PATIENCE_SETTLING = 30.0
RESUME_RETRY_SECONDS = 0.5  # between two tries


class Migrations:
    """Every request in flight (`placements`), and the moves of those that must move.

    `admit` sends a request into the pipeline (raising OpenAIError when it is refused);
    `abort` tells the engines to drop a request (up to an attempt)."""

    def __init__(self, runtime: ServiceRuntime, copies: dict[str, Liveness],
                 admit: Callable[[GenerateRequest], Awaitable[Admission]],
                 abort: Callable[[str], Awaitable[None]],
                 migration_limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        self.runtime = runtime
        self.copies = copies
        self.admit = admit
        self.abort = abort
        self.migration_limit = migration_limit
        self.on_migrated: Callable[[], object] = lambda: None  # the metrics' counter
        # Each request in flight: where it runs and what its client has (migration.py).
        self.placements: dict[str, Placement] = {}
        self._tasks: set[asyncio.Task] = set()  # migrations and aborts under way
        self._watchdog: asyncio.Task | None = None

    def track(self, request: GenerateRequest, queue: asyncio.Queue) -> Placement:
        """A request on its way into the pipeline, its deltas to `queue`. Until `admitted`,
        it is moving: a fault meanwhile moves it once its admission is back, not while the
        first attempt may still be admitted by an engine (which would refuse it as stale).
        Its tokens are not to go to a detokenizer copy this api took for dead: the request to
        send is `placement.request`."""
        lost = self.lost_detokenizers()
        request = msgspec.structs.replace(request, avoid_detokenizer_ids=lost)
        placement = self.placements[request.request_id] = Placement(
            request, queue, moving=True, avoided_detokenizers=frozenset(lost))
        return placement

    def admitted(self, placement: Placement, admission: Admission) -> None:
        """The first attempt's admission came back: where it runs; if a fault came meanwhile,
        it moves now."""
        self._settle(placement, admission)

    def _settle(self, placement: Placement, admission: Admission) -> None:
        """An attempt's admission is back: it runs there now. Faults of that engine judged
        while the admission was on its way (the attempt was moving, so they were taken for
        the old attempt's) are checked here against what the api knows of the engine now: one
        reaped meanwhile, or reconnected since it took the attempt, moves it again."""
        placement.scheduler_instance_id = admission.scheduler_instance_id
        placement.scheduler_reconnects = admission.scheduler_reconnects
        placement.moving = False
        schedulers = self.copies["scheduler"]
        latest = schedulers.latest.get(admission.scheduler_instance_id)
        if admission.scheduler_instance_id in schedulers.reaped:
            placement.failed_meanwhile = placement.failed_meanwhile or (
                f"engine {admission.scheduler_instance_id} stopped answering")
        elif latest is not None and latest.num_reconnects > admission.scheduler_reconnects:
            placement.failed_meanwhile = placement.failed_meanwhile or (
                f"engine {latest.engine_id} lost its bus connection")
        self._move_again(placement)

    def lost_detokenizers(self) -> list[str]:
        """The detokenizer copies this api reaped (and has not heard from since): what an
        engine sends them is lost without a word, so no request's tokens are to go there."""
        return sorted(self.copies["detokenizer"].reaped)

    def forget(self, request_id: str) -> None:
        """It ended, or its client left: nothing of it moves any more."""
        self.placements.pop(request_id, None)

    def start(self) -> None:
        self._watchdog = asyncio.create_task(self._watch_engines())
        self.runtime.on_reconnect(self._on_reconnect)

    def on_delta(self, delta: TextDelta) -> None:
        """To its client's queue if it is the stream's next text; else see migration.py."""
        placement = self.placements.get(delta.request_id)
        if placement is None:
            return  # it ended (or its client left)
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
            self.placements.pop(request_id, None)
            return
        old = placement.attempt
        request = placement.next_attempt(avoid_instance_id, self.lost_detokenizers())
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
            self.placements.pop(request_id, None)
            return
        if self.placements.get(request_id) is not placement:  # its client left meanwhile
            await self.abort(request_id)
            return
        self.on_migrated()
        log.info("request migrated", request_id=request_id, attempt=placement.attempt,
                 reason=reason, scheduler=admission.scheduler_instance_id,
                 resumed_tokens=[len(c.output_token_ids) for c in request.resumed])
        self._settle(placement, admission)

    async def _admit_soon(self, request: GenerateRequest) -> Admission:
        """Admit a resumed request, retrying while no engine takes it (503): after a bus
        outage the stages reconnect one by one, and this copy may be first. A few seconds,
        or longer while the pipeline is settling (RESUME_PATIENCE_SETTLING)."""
        started = time.monotonic()
        while True:
            try:
                return await self.admit(request)
            except OpenAIError as exc:
                waited = time.monotonic() - started
                if exc.status_code != 503 or waited > RESUME_PATIENCE_SETTLING or (
                        waited > RESUME_PATIENCE and not self._settling()):
                    raise
            await asyncio.sleep(RESUME_RETRY_SECONDS)

    def _settling(self) -> bool:
        """Whether a 503 may be the cluster settling rather than an empty pipeline: this copy
        is off the bus, or a tokenizer and an engine that admits requests (its scheduler, not
        a prefill engine's, and its executor) are still counted alive. Without them the
        request fails after RESUME_PATIENCE, as before (one engine whose executor died, or
        only a prefill engine left: within seconds)."""
        if not self.runtime.connected:
            return True
        now = self.runtime.bus_time()
        admitting = {h.engine_id for h in self.copies["scheduler"].alive(now)
                     if h.role != "prefill"}
        return bool(self.copies["tokenizer"].alive(now)) and any(
            h.engine_id in admitting for h in self.copies["executor"].alive(now))

    def _detokenizers_may_return(self, now: float) -> bool:
        """Every detokenizer copy is silent: whether they may be moving to another server
        rather than dead. So when copies of other stages fell silent within `dead_after` of
        the last detokenizer heartbeat (one cause, such as a server they shared going away),
        for at most RESUME_PATIENCE_SETTLING. A silence of the detokenizers alone, their own
        deaths, ends every request at once."""
        detokenizers = self.copies["detokenizer"]
        last_heard = max(detokenizers.last_seen.values())
        if now - last_heard > RESUME_PATIENCE_SETTLING:
            return False
        return any(abs(silent - last_heard) <= detokenizers.dead_after
                   for stage, liveness in self.copies.items() if stage != "detokenizer"
                   for silent in liveness.fell_silent(now))

    def _move_again(self, placement: Placement) -> None:
        """The attempt just admitted failed before its admission came back: it moves too."""
        if placement.failed_meanwhile:
            reason, placement.failed_meanwhile = placement.failed_meanwhile, ""
            self._migrate(placement, reason)

    async def _on_reconnect(self) -> None:
        """Back on the bus: deltas sent to this copy meanwhile are lost. Every request in
        flight resumes from what its client has; prefix caching makes that cheap where it
        lands on the same engine."""
        for placement in list(self.placements.values()):
            self._migrate(placement, "the api lost its bus connection")

    def recover_from(self, copy: Heartbeat) -> None:
        """An engine reconnected: what it sent while its connection was down may be lost (a
        request's last tokens, its end, which no gap would show), so the requests it held
        from before resume. (A detokenizer copy ends those it holds itself, on_reconnect.)"""
        if copy.service != "scheduler":
            return
        for placement in list(self.placements.values()):
            if (placement.scheduler_instance_id == copy.instance_id and not placement.moving
                    and placement.scheduler_reconnects < copy.num_reconnects):
                self._migrate(placement, f"engine {copy.engine_id} lost its bus connection")

    async def _watch_engines(self) -> None:
        """When an engine falls silent, its requests resume on another engine (migration).
        Nothing is judged while this copy is off the bus: the silence is ours."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            if not self.runtime.connected:
                continue
            now = self.runtime.bus_time()
            # Every detokenizer copy gone: no text can reach any client until one is back.
            detokenizers = self.copies["detokenizer"]
            if detokenizers.last_seen and not detokenizers.alive(now):
                if self._detokenizers_may_return(now):
                    continue  # the cluster settling: nothing is judged until they are back
                silence = now - max(detokenizers.last_seen.values())
                for request_id, placement in list(self.placements.items()):
                    self.placements.pop(request_id, None)
                    placement.end_with_error(
                        f"no detokenizer copy is alive (none heard from for {silence:.0f} s)")
                continue
            dead = {h.instance_id: h for h in self.copies["scheduler"].reap(now)}
            # A dead copy took with it the text it held, and tokens sent to it since: its
            # requests resume (those with no text yet may have been its too).
            lost_copies = {h.instance_id for h in detokenizers.reap(now)}
            for request_id, placement in list(self.placements.items()):
                # A moving request's engine is the old attempt's (the admission checks anew).
                gone = None if placement.moving else dead.get(placement.scheduler_instance_id)
                if gone is not None:
                    log.warning("engine gone", request_id=request_id, engine=gone.engine_id)
                    self._migrate(placement, f"engine {gone.engine_id} stopped answering",
                                  avoid_instance_id=gone.instance_id)
                elif (lost_copies and placement.decoded_by(lost_copies)
                      and not (placement.moving and lost_copies <= placement.avoided_detokenizers)):
                    self._migrate(placement, f"detokenizer {', '.join(sorted(lost_copies))} "
                                  "stopped answering")

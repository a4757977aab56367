"""The engine loop's rules, apart from the bus: plan, execute, publish, until stopped.

With pipeline depth 2 the next plan is sent while the executor still runs the current one, so
the bus round trip and the planning hide behind the forward; the executor handles its requests
one at a time, in order. The rules:

- plan while there is work and fewer than `depth` steps are in flight; a step with nothing
  scheduled goes out only when none is in flight (its bookkeeping — forgotten and preempted
  requests — otherwise rides the next plan);
- plan nothing behind a multi-step plan (multi_step.py): it runs several forwards, which hide
  the round trip on their own, and a request that arrives meanwhile then waits for one such
  plan, not two; while it runs, each forward's tokens (StepProgress) are published as they
  come (`progress`), if that plan is the one awaited;
- when a step fails (the executor answered an error, timed out, or fell silent), cancel the
  other steps in flight and end every request with an explicit error: never hang. The same
  when the service interrupts the loop (its bus connection, or its executor's, dropped: step
  results and token batches may be lost). These errors are resumable: the api moves the
  requests to an engine that resumes them;
- when idle, publish what ended and sleep until woken (a submit, an abort) or a second passes
  (to expire requests queued too long).

The service (service.py) injects the executor (`execute`) and the publisher (`publish`); tests
drive the loop with a fake executor and no NATS.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from llmbus.bus.messages import RequestTokens, StepPlan, StepProgress, StepResult
from llmbus.services.scheduler.scheduler import Scheduler

log = structlog.get_logger()

SILENCE_CHECK_SECONDS = 0.5  # how often a step's wait asks whether the executor went silent


class EngineLoop:
    def __init__(self, scheduler: Scheduler, *,
                 execute: Callable[[StepPlan], Coroutine[Any, Any, StepResult]],
                 publish: Callable[[list[RequestTokens], bool], Awaitable[None]],
                 expired: Callable[[float], list[RequestTokens]],
                 executor_silent: Callable[[], bool] = lambda: False,
                 depth: int = 2, clock: Callable[[], float] = time.time,
                 name: str = "the engine") -> None:
        """`publish(updates, cache_cleared)` sends token updates; `expired(now)` ends the
        requests queued too long; `executor_silent()` says the executor stopped sending
        heartbeats. `name` ("engine e1") names the engine in the errors clients get."""
        self.scheduler, self.depth, self.clock, self.name = scheduler, depth, clock, name
        self.execute, self.publish, self.expired = execute, publish, expired
        self.executor_silent = executor_silent
        self.wakeup = asyncio.Event()
        self.busy_seconds = 0.0  # the executor's forward time
        self.idle_seconds = 0.0  # the executor waiting for a plan while the engine was busy
        self._interrupted = ""  # why the requests held at the interrupt must end now
        self._held: set[tuple[str, int]] = set()  # those, as (request id, attempt)
        self._awaited: StepPlan | None = None  # the step whose result the loop waits for

    def interrupt(self, reason: str) -> None:
        """End every request held now, and every one in a step in flight, with a resumable
        error, from the loop, as soon as it looks (a step awaited fails at once). Attempts
        admitted after this (a migration's) go on."""
        self._interrupted = reason
        self._held |= {(r.request_id, r.attempt) for r in self.scheduler.table}
        self.wakeup.set()

    async def run(self) -> None:
        scheduler = self.scheduler
        in_flight: deque[tuple[StepPlan, asyncio.Task, bool]] = deque()
        continuing = False  # was the engine busy right before this step? (idle accounting)
        while True:
            if self._interrupted:
                await self._fail_held(in_flight)
            continuing = self._send_plans(in_flight, continuing)
            if not in_flight:
                await self._idle()
                continuing = False
                continue
            plan, task, counted = in_flight.popleft()
            self._awaited = plan
            try:
                result = await self._await_step(task)
            except Exception as exc:  # executor gone, timed out or failed: fail, never hang
                log.error("step failed", step_id=plan.step_id, error=str(exc))
                if self._interrupted:
                    in_flight.appendleft((plan, task, counted))
                    await self._fail_held(in_flight)
                else:
                    await self._fail(in_flight, f"{self.name}'s executor failed: "
                                     f"{exc or type(exc).__name__}")
                continuing = False
                continue
            finally:
                self._awaited = None
            self.busy_seconds += result.forward_seconds
            if counted:
                self.idle_seconds += result.idle_seconds
            now = self.clock()
            await self.publish(scheduler.update(plan, result, now) + self.expired(now), False)
            await asyncio.sleep(0)  # let submits and aborts in between steps

    async def progress(self, progress: StepProgress) -> None:
        """A forward's tokens of a plan of several (the executor's StepProgress): sent on now
        if that plan is the one awaited; else its result brings them."""
        plan = self._awaited
        if plan is not None and plan.step_id == progress.step_id and plan.multi_step():
            await self.publish(self.scheduler.stream(plan, progress, self.clock()), False)

    async def _fail(self, in_flight: deque[tuple[StepPlan, asyncio.Task, bool]],
                    reason: str) -> None:
        for _, task, _ in in_flight:
            task.cancel()
        in_flight.clear()
        scheduler = self.scheduler
        await self.publish(scheduler.take_ended_updates() + scheduler.fail_all(reason), True)

    async def _fail_held(self, in_flight: deque[tuple[StepPlan, asyncio.Task, bool]]) -> None:
        """The interrupt's: the requests held at it and those of the steps in flight end; the
        prefix cache is emptied if a step was lost (its blocks may never have been written)."""
        scheduler, reason = self.scheduler, self._interrupted
        held, self._held, self._interrupted = self._held, set(), ""
        for plan, task, _ in in_flight:
            task.cancel()
            for item in plan.scheduled:
                request = scheduler.table.get(item.sequence_id)
                if request is not None:
                    held.add((request.request_id, request.attempt))
        lost_a_step = bool(in_flight)
        in_flight.clear()
        for request_id, attempt in held:
            scheduler.abort_request(request_id, error=reason, up_to_attempt=attempt,
                                    resumable=True)
        if lost_a_step:
            scheduler.kv.clear_cache()
        await self.publish(scheduler.take_ended_updates(), lost_a_step)

    def _send_plans(self, in_flight: deque[tuple[StepPlan, asyncio.Task, bool]],
                    continuing: bool) -> bool:
        """Plan and send steps up to the pipeline depth; returns `continuing` for the next."""
        scheduler = self.scheduler
        while ((scheduler.has_work or (scheduler.has_bookkeeping and not in_flight))
               and len(in_flight) < self.depth
               and not any(p.multi_step() for p, _, _ in in_flight)):
            plan = scheduler.schedule(self.clock())
            if not plan.scheduled and in_flight:
                scheduler.unschedule_empty(plan)
                break
            in_flight.append((plan, asyncio.create_task(self.execute(plan)), continuing))
            continuing = True
        return continuing

    async def _idle(self) -> None:
        await self.publish(self.scheduler.take_ended_updates(), False)
        self.wakeup.clear()
        try:  # wake up now and then to expire requests queued for too long
            await asyncio.wait_for(self.wakeup.wait(), timeout=1.0)
        except TimeoutError:
            pass
        await self.publish(self.expired(self.clock()), False)

    async def _await_step(self, task: asyncio.Task) -> StepResult:
        """The step's result; fails fast if the executor stops sending heartbeats."""
        while True:
            done, _ = await asyncio.wait({task}, timeout=SILENCE_CHECK_SECONDS)
            if done:
                result = task.result()
                if result.error:
                    raise RuntimeError(result.error)
                return result
            if self.executor_silent():
                task.cancel()
                raise RuntimeError("it stopped responding")
            if self._interrupted:
                task.cancel()
                raise RuntimeError(self._interrupted)

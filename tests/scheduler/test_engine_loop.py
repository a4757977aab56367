"""The engine loop's pipelining rules with a fake executor: no NATS, no model.

The fake executor answers each plan with token 7 for every sampling row, when the test lets
it (a gate per step), so a test can see which plans are in flight at once."""

from __future__ import annotations

import asyncio

import pytest

from llmbus.bus.messages import (
    FinishReason,
    RequestTokens,
    SamplingParams,
    StepPlan,
    StepProgress,
    StepResult,
)
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.engine_loop import EngineLoop
from llmbus.services.scheduler.scheduler import Scheduler

TIMEOUT = 10.0  # generous: the loop's own waits are milliseconds


class FakeExecutor:
    def __init__(self, *, error_at_step: int | None = None, hang: bool = False) -> None:
        self.plans: list[StepPlan] = []
        self.answered = 0
        self.unanswered_at_send: list[int] = []  # per plan: others still in flight
        self.behind_multi_step: list[int] = []  # plans sent while a multi-step one was out
        self.error_at_step, self.hang = error_at_step, hang
        self.gates: dict[int, asyncio.Event] = {}

    def gate(self, step_id: int) -> asyncio.Event:
        return self.gates.setdefault(step_id, asyncio.Event())

    async def __call__(self, plan: StepPlan) -> StepResult:
        self.unanswered_at_send.append(len(self.plans) - self.answered)
        if any(s.num_steps > 1 for p in self.plans[self.answered:] for s in p.scheduled):
            self.behind_multi_step.append(plan.step_id)
        self.plans.append(plan)
        if self.hang:
            await asyncio.Event().wait()
        await self.gate(plan.step_id).wait()
        self.answered += 1
        if plan.step_id == self.error_at_step:
            return StepResult(step_id=plan.step_id, error="the fake executor failed")
        return StepResult(step_id=plan.step_id, forward_seconds=0.001,
                          sampled_token_ids=[7] * sum(s.sample * s.num_steps
                                                      for s in plan.scheduled),
                          num_sampled=[s.num_steps for s in plan.scheduled if s.sample])


class Published:
    def __init__(self) -> None:
        self.updates: list[RequestTokens] = []
        self.cache_cleared = 0

    async def __call__(self, updates: list[RequestTokens], cache_cleared: bool) -> None:
        self.updates += updates
        self.cache_cleared += cache_cleared

    def finished(self) -> dict[str, FinishReason]:
        return {u.request_id: u.finish_reason for u in self.updates if u.finish_reason}


def _engine(executor: FakeExecutor, depth: int = 2, silent=lambda: False, decode_steps: int = 1,
            ) -> tuple[EngineLoop, Published]:
    scheduler = Scheduler(SchedulerConfig(num_blocks=33, block_size=4, max_model_len=64,
                                          eos_token_ids=(2,), decode_steps=decode_steps))
    published = Published()
    loop = EngineLoop(scheduler, execute=executor, publish=published, expired=lambda now: [],
                      executor_silent=silent, depth=depth)
    return loop, published


def _add(loop: EngineLoop, request_id: str, max_tokens: int = 3) -> None:
    loop.scheduler.add_request(request_id, "api.x", [10, 11, 12],
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    loop.wakeup.set()


async def _until(condition, what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():
            await asyncio.sleep(0.001)
    assert condition(), what


async def _open_gates(executor: FakeExecutor, done, never: frozenset[int] = frozenset()
                      ) -> None:
    """Answer every step (but those in `never`) as soon as it is sent, until `done()`."""
    async with asyncio.timeout(TIMEOUT):
        while not done():
            for plan in executor.plans:
                if plan.step_id not in never:
                    executor.gate(plan.step_id).set()
            await asyncio.sleep(0.001)


@pytest.mark.asyncio
@pytest.mark.parametrize("depth", [1, 2])
async def test_depth_bounds_the_steps_in_flight(depth):
    executor = FakeExecutor()
    loop, published = _engine(executor, depth)
    task = asyncio.create_task(loop.run())
    try:
        _add(loop, "a", max_tokens=4)
        await _until(lambda: len(executor.plans) == depth, f"{depth} plans sent")
        await asyncio.sleep(0.05)  # nothing more goes out while they are unanswered
        assert len(executor.plans) == depth and executor.answered == 0
        await _open_gates(executor, lambda: "a" in published.finished())
        assert published.finished() == {"a": FinishReason.LENGTH}
        assert [t for u in published.updates for t in u.new_token_ids] == [7] * 4
        assert loop.busy_seconds > 0
    finally:
        task.cancel()


@pytest.mark.asyncio
async def test_nothing_is_planned_behind_a_multi_step_plan():
    """Single steps pipeline; a plan of several forwards goes out alone, so a request that
    arrives meanwhile waits for one such plan, not two."""
    executor = FakeExecutor()
    loop, published = _engine(executor, depth=2, decode_steps=4)
    task = asyncio.create_task(loop.run())
    try:
        _add(loop, "a", max_tokens=20)
        await _open_gates(executor, lambda: "a" in published.finished())
        multi = [p.step_id for p in executor.plans if any(s.num_steps > 1 for s in p.scheduled)]
        assert len(multi) >= 3, executor.plans
        assert executor.behind_multi_step == []
        assert max(executor.unanswered_at_send) == 1  # the prefill had a step planned behind it
        assert [t for u in published.updates for t in u.new_token_ids] == [7] * 20
    finally:
        task.cancel()


@pytest.mark.asyncio
async def test_a_multi_step_plans_tokens_go_out_as_its_forwards_sample_them():
    """While a plan of 4 forwards runs, each forward's StepProgress is published at once; a
    progress of another plan, or out of order, is not; the result brings the rest."""
    executor = FakeExecutor()
    loop, published = _engine(executor, depth=2, decode_steps=4)
    task = asyncio.create_task(loop.run())
    try:
        _add(loop, "a", max_tokens=20)
        await _until(lambda: executor.plans, "the prefill sent")
        executor.gate(0).set()
        await _until(lambda: len(executor.plans) == 2, "a plan of several forwards sent")
        plan = executor.plans[1]
        assert [s.num_steps for s in plan.scheduled] == [4]
        await _until(lambda: loop._awaited is plan, "its result awaited")
        num_before = len(published.updates)
        await loop.progress(StepProgress(step_id=plan.step_id + 1, forward=0,
                                         sampled_token_ids=[7]))  # not this plan's
        await loop.progress(StepProgress(step_id=plan.step_id, forward=1,
                                         sampled_token_ids=[7]))  # forward 0 first
        assert len(published.updates) == num_before
        for forward in range(3):
            await loop.progress(StepProgress(step_id=plan.step_id, forward=forward,
                                             sampled_token_ids=[7]))
            assert [u.new_token_ids for u in published.updates[num_before:]] == [[7]] * (
                forward + 1)
        await _open_gates(executor, lambda: "a" in published.finished())
        assert [t for u in published.updates for t in u.new_token_ids] == [7] * 20
    finally:
        task.cancel()


@pytest.mark.asyncio
async def test_no_empty_step_is_sent_while_one_is_in_flight():
    """A request whose last token is on the way has nothing to schedule: the loop waits for
    that step instead of sending an empty one beside it. An abort's bookkeeping then rides a
    plan of its own once nothing is in flight."""
    executor = FakeExecutor()
    loop, published = _engine(executor)
    task = asyncio.create_task(loop.run())
    try:
        _add(loop, "a", max_tokens=2)  # step 0 samples token 1, step 1 token 2: then nothing
        await _until(lambda: len(executor.plans) == 2, "steps 0 and 1 in flight")
        executor.gate(0).set()
        await _until(lambda: published.updates, "step 0's token published")
        await asyncio.sleep(0.05)
        assert len(executor.plans) == 2  # nothing to plan until step 1 answers
        await _open_gates(executor, lambda: "a" in published.finished())
        _add(loop, "b", max_tokens=50)
        await _open_gates(executor, lambda: any(p.scheduled and p.scheduled[0].sequence_id == "b"
                                                for p in executor.plans))
        loop.scheduler.abort_request("b")
        loop.wakeup.set()
        await _open_gates(executor, lambda: any("b" in p.finished_sequence_ids
                                                for p in executor.plans))
        for plan, others in zip(executor.plans, executor.unanswered_at_send, strict=True):
            assert plan.scheduled or others == 0, (plan, others)
        assert not executor.plans[-1].scheduled  # the bookkeeping went out alone, at the end
        assert published.finished() == {"a": FinishReason.LENGTH, "b": FinishReason.ABORT}
    finally:
        task.cancel()


@pytest.mark.asyncio
async def test_a_failed_step_ends_every_request_and_the_loop_goes_on():
    executor = FakeExecutor(error_at_step=0)
    loop, published = _engine(executor)
    task = asyncio.create_task(loop.run())
    try:
        _add(loop, "a")
        _add(loop, "b")
        # step 1, sent beside the failing step 0, never answers: it is dropped, not awaited
        await _open_gates(executor, lambda: len(published.finished()) == 2, never={1})
        assert published.finished() == {"a": FinishReason.ERROR, "b": FinishReason.ERROR}
        assert all("the fake executor failed" in u.error for u in published.updates
                   if u.finish_reason)
        assert published.cache_cleared == 1
        assert not loop.scheduler.has_work
        _add(loop, "c")  # the engine serves on
        await _open_gates(executor, lambda: "c" in published.finished(), never={1})
        assert published.finished()["c"] == FinishReason.LENGTH
    finally:
        task.cancel()


@pytest.mark.asyncio
async def test_a_silent_executor_fails_the_requests_instead_of_hanging():
    executor = FakeExecutor(hang=True)
    silent = False
    loop, published = _engine(executor, silent=lambda: silent)
    task = asyncio.create_task(loop.run())
    try:
        _add(loop, "a")
        await _until(lambda: executor.plans, "a plan sent")
        silent = True  # its heartbeats stopped
        await _until(lambda: "a" in published.finished(), "the request ended")
        assert published.finished() == {"a": FinishReason.ERROR}
        assert "stopped responding" in published.updates[-1].error
    finally:
        task.cancel()


@pytest.mark.asyncio
async def test_an_interrupt_ends_what_was_held_and_spares_what_came_after():
    """The bus dropped (the scheduler's connection, or its executor's): the request held
    then, whose step's result may be lost, ends with a resumable error; a request admitted
    after the interrupt (a migration's next attempt, say) is served."""
    executor = FakeExecutor()
    loop, published = _engine(executor)
    task = asyncio.create_task(loop.run())
    try:
        _add(loop, "held")
        await _until(lambda: executor.plans, "a step in flight")
        loop.interrupt("engine e0 lost its bus connection")
        _add(loop, "after")
        await _until(lambda: "held" in published.finished(), "the held request ended")
        for step in range(1, 20):
            executor.gate(step).set()
        await _until(lambda: "after" in published.finished(), "the later request ended")
        [end] = [u for u in published.updates if u.request_id == "held" and u.finish_reason]
        assert (end.finish_reason, end.resumable) == (FinishReason.ERROR, True)
        assert end.error == "engine e0 lost its bus connection"
        assert published.finished()["after"] == FinishReason.LENGTH
        assert published.cache_cleared == 1  # its step was lost: cached blocks may be unwritten
        loop.scheduler.check_invariants()
    finally:
        task.cancel()

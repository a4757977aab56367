"""The scheduler's bus adapter without the model: the real SchedulerService on a real
nats-server, with a fake executor (answers info and steps, sends heartbeats) and a fake
detokenizer copy. Admission, tokens on the wire, and an executor that dies mid-request."""

from __future__ import annotations

import asyncio

import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.liveness import HEARTBEAT_INTERVAL
from llmbus.bus.messages import (
    AbortRequest,
    Admission,
    ErrorCode,
    ExecutorInfo,
    FinishReason,
    GrammarReply,
    GrammarRequest,
    Heartbeat,
    SamplingParams,
    StepPlan,
    StepResult,
    StructuredOutput,
    SubmitRequest,
    TokenBatch,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.cli import build_parser
from llmbus.services.launcher import Stack
from llmbus.services.scheduler.service import SchedulerService, _run_until_stopped

TIMEOUT = 20.0
ENGINE = "engine0"


class FakeExecutor:
    """Samples token 7 for every sampling row (each of its steps); `alive = False` stops
    heartbeats and answers."""

    def __init__(self) -> None:
        self.alive = True
        self.steps: list[StepPlan] = []
        self.compiled = asyncio.Event()  # grammar requests wait for this
        self.compiled.set()
        self.grammars: list[GrammarRequest] = []

    async def start(self, url: str) -> None:
        self.nc = await nats.connect(url)
        await self.nc.subscribe(subjects.executor_info(ENGINE), cb=self.on_info)
        await self.nc.subscribe(subjects.executor_step(ENGINE), cb=self.on_step)
        await self.nc.subscribe(subjects.executor_grammar(ENGINE), cb=self.on_grammar)
        await self.nc.flush()
        self.beating = asyncio.create_task(self.beat())

    async def beat(self) -> None:
        while True:
            if self.alive:
                await self.nc.publish(subjects.heartbeat("executor"), encode(Heartbeat(
                    service="executor", instance_id="x1", engine_id=ENGINE)))
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def on_info(self, msg) -> None:
        await msg.respond(encode(ExecutorInfo(model_name="tiny", max_model_len=64,
                                              num_blocks=17, block_size=4, eos_token_ids=[2],
                                              vocab_size=100)))

    async def on_step(self, msg) -> None:
        plan = decode(msg.data, StepPlan)
        self.steps.append(plan)
        if not self.alive:
            return  # a dead process answers nothing
        counts = [s.num_steps for s in plan.scheduled if s.sample]  # multi-step: several each
        await msg.respond(encode(StepResult(
            step_id=plan.step_id, sampled_token_ids=[7] * sum(counts), num_sampled=counts,
            forward_seconds=0.001)))

    async def on_grammar(self, msg) -> None:
        """Compiles once `compiled` is set; a spec saying "bad" does not compile."""
        request = decode(msg.data, GrammarRequest)
        self.grammars.append(request)
        await self.compiled.wait()
        error = "no such grammar" if "bad" in request.structured.spec else ""
        await msg.respond(encode(GrammarReply(error=error)))

    async def close(self) -> None:
        self.beating.cancel()
        await self.nc.close()


@pytest.fixture
async def engine():
    stack = Stack()
    url = stack.start_nats(auth=False)
    executor = FakeExecutor()
    await executor.start(url)
    tokens: list[TokenBatch] = []
    watcher = await nats.connect(url)

    async def on_tokens(msg) -> None:
        tokens.append(decode(msg.data, TokenBatch))

    await watcher.subscribe(subjects.DETOKENIZER_TOKENS, cb=on_tokens)
    await watcher.flush()  # the server has the subscription before any token is sent
    args = build_parser().parse_args(["serve", "scheduler", "--nats-url", url])
    try:
        async with ServiceRuntime("scheduler", url) as runtime:
            service = SchedulerService(runtime, args)
            await service.start()
            runtime.mark_ready(service.heartbeat)
            running = asyncio.create_task(_run_until_stopped(service, shutdown_timeout=1.0))
            yield runtime, executor, tokens, service
            runtime.stop_event.set()
            await running
    finally:
        await watcher.close()
        await executor.close()
        stack.stop()


async def _submit(runtime: ServiceRuntime, request_id: str, max_tokens: int,
                  structured: StructuredOutput | None = None) -> Admission:
    return await runtime.request(subjects.engine_submit(ENGINE), SubmitRequest(
        request_id=request_id, reply_subject="api.x", prompt_token_ids=[10, 11, 12],
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured=structured)),
        Admission, timeout=5)


async def _until(condition, what: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():
            await asyncio.sleep(0.01)


def _items(tokens: list[TokenBatch], request_id: str):
    return [item for batch in tokens for item in batch.items if item.request_id == request_id]


@pytest.mark.asyncio
async def test_a_request_runs_on_the_fake_executor_and_its_tokens_go_out(engine):
    runtime, executor, tokens, _ = engine
    admission = await _submit(runtime, "r1", max_tokens=5)
    assert admission.error_code == 0 and admission.num_prompt_tokens == 3
    assert admission.scheduler_instance_id == runtime.instance_id
    await _until(lambda: any(i.finish_reason for i in _items(tokens, "r1")), "r1 finished")
    items = _items(tokens, "r1")
    assert [t for i in items for t in i.new_token_ids] == [7] * 5
    assert items[-1].finish_reason == FinishReason.LENGTH
    assert executor.steps[0].new_requests[0].prompt_token_ids == [10, 11, 12]


@pytest.mark.asyncio
async def test_requests_too_big_for_the_engine_are_refused_at_admission(engine):
    runtime, _, _, _ = engine
    admission = await _submit(runtime, "big", max_tokens=100)  # 64-token context
    assert admission.error_code != 0 and admission.error_param == "max_tokens"


@pytest.mark.asyncio
async def test_an_executor_that_dies_mid_request_ends_it_with_an_error(engine):
    runtime, executor, tokens, service = engine
    await _until(lambda: service.executor.last_seen, "the scheduler heard the executor")
    executor.alive = False  # its heartbeats stop; steps go unanswered
    await _submit(runtime, "r2", max_tokens=50)
    await _until(lambda: any(i.finish_reason for i in _items(tokens, "r2")), "r2 ended")
    [last] = [i for i in _items(tokens, "r2") if i.finish_reason]
    assert last.finish_reason == FinishReason.ERROR and "executor" in last.error


async def _submit_while_compiling(runtime: ServiceRuntime, executor: FakeExecutor,
                                  request_id: str, regex: str) -> asyncio.Task:
    """Submit a constrained request whose grammar the executor holds until `compiled` is
    set; returns the submit's task once the executor was asked."""
    executor.compiled.clear()
    task = asyncio.create_task(_submit(runtime, request_id, max_tokens=3, structured=(
        StructuredOutput(kind="regex", spec=regex, param="guided_regex"))))
    await _until(lambda: executor.grammars, "the executor was asked to compile")
    return task


@pytest.mark.asyncio
async def test_a_constrained_request_waits_for_its_grammar_and_the_others_do_not(engine):
    runtime, executor, tokens, _ = engine
    constrained = await _submit_while_compiling(runtime, executor, "c1", "[0-9]+")
    admission = await _submit(runtime, "plain", max_tokens=3)  # not stuck behind c1
    assert admission.error_code == 0 and not constrained.done()
    await _until(lambda: any(i.finish_reason for i in _items(tokens, "plain")), "plain ran")
    assert not any(n.sequence_id == "c1" for p in executor.steps for n in p.new_requests)
    executor.compiled.set()
    assert (await constrained).error_code == 0
    await _until(lambda: any(i.finish_reason for i in _items(tokens, "c1")), "c1 ran")
    assert executor.grammars[0].structured.spec == "[0-9]+"


@pytest.mark.asyncio
async def test_a_constraint_the_executor_cannot_compile_is_refused_at_admission(engine):
    runtime, executor, _, _ = engine
    admission = await _submit(runtime, "c2", max_tokens=3, structured=StructuredOutput(
        kind="grammar", spec="bad", param="guided_grammar"))
    assert admission.error_code == ErrorCode.INVALID_REQUEST
    assert admission.error_param == "guided_grammar" and "no such grammar" in (
        admission.error_message)
    assert not any(n.sequence_id == "c2" for p in executor.steps for n in p.new_requests)


@pytest.mark.asyncio
async def test_a_request_aborted_while_its_grammar_compiles_never_runs(engine):
    runtime, executor, _, service = engine
    submitting = await _submit_while_compiling(runtime, executor, "c3", "[a-z]+")
    await runtime.publish(subjects.SCHEDULER_ABORT, AbortRequest(request_id="c3"))
    await _until(lambda: service._compiling_ids.get("c3"), "the scheduler took the abort")
    executor.compiled.set()
    admission = await submitting
    assert admission.error_code == ErrorCode.INVALID_REQUEST and "aborted" in (
        admission.error_message)
    assert not any(n.sequence_id == "c3" for p in executor.steps for n in p.new_requests)

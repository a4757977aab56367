# Over 300 lines: every test of the scheduler's adapter shares one engine fixture and its fake
# executor and detokenizer copies.
"""The scheduler's bus adapter without the model: the real SchedulerService on a real
nats-server, with a fake executor (answers info and steps, sends heartbeats) and fake
detokenizer copies. Admission, tokens on the wire (a completion's constants once per copy), an
executor that dies mid-request, a detokenizer copy that cannot decode a completion."""

from __future__ import annotations

import asyncio
import time

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
    UnknownCompletion,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.cli import build_parser
from llmbus.services.launcher import Stack
from llmbus.services.scheduler.config import config_from_args
from llmbus.services.scheduler.detokenizer_routing import preferred_copy
from llmbus.services.scheduler.service import SchedulerService, _run_until_stopped

pytestmark = pytest.mark.adapter  # a real nats-server, no model

TIMEOUT = 20.0
ENGINE = "engine0"


class FakeExecutor:
    """Samples token 7 for every sampling row (each of its steps); `alive = False` stops
    heartbeats and answers; with `max_answered` set, steps past that many wait."""

    def __init__(self) -> None:
        self.alive = True
        self.max_answered: int | None = None
        self.num_answered = 0
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
        while self.max_answered is not None and self.num_answered >= self.max_answered:
            await asyncio.sleep(0.01)
        self.num_answered += 1
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
            service = SchedulerService(runtime, config_from_args(args))
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
    await _until(lambda: service.peers.executor.last_seen, "the scheduler heard the executor")
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
    await _until(lambda: service.grammars.compiling.get(("c3", 0)), "the scheduler took the abort")
    executor.compiled.set()
    admission = await submitting
    assert admission.error_code == ErrorCode.INVALID_REQUEST and "aborted" in (
        admission.error_message)
    assert not any(n.sequence_id == "c3" for p in executor.steps for n in p.new_requests)


class FakeDetokenizer:
    """One detokenizer copy as the scheduler sees it: heartbeats as `instance`, and keeps the
    token batches sent to its own subject."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.batches: list[TokenBatch] = []

    async def start(self, runtime: ServiceRuntime, service: SchedulerService) -> None:
        async def on_tokens(msg) -> None:
            self.batches.append(decode(msg.data, TokenBatch))

        self.subscription = await runtime.nc.subscribe(
            subjects.detokenizer_tokens(self.instance), cb=on_tokens)
        await runtime.nc.flush()
        self.beating = asyncio.create_task(self.beat(runtime))
        await _until(lambda: service.detokenizers.liveness.alive(time.monotonic()),
                     "the scheduler heard the detokenizer copy")

    async def beat(self, runtime: ServiceRuntime) -> None:
        while True:
            await runtime.publish(subjects.heartbeat("detokenizer"), Heartbeat(
                service="detokenizer", instance_id=self.instance))
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def stop(self) -> None:
        self.beating.cancel()
        await self.subscription.unsubscribe()


@pytest.mark.asyncio
async def test_a_completions_constants_go_to_its_detokenizer_copy_once(engine):
    """n = 2 completions of 20 tokens, in several batches each: each completion's start (its
    reply subject and stop strings) comes once, with its first tokens."""
    runtime, _, _, service = engine
    detokenizer = FakeDetokenizer("d1")
    await detokenizer.start(runtime, service)
    await runtime.request(subjects.engine_submit(ENGINE), SubmitRequest(
        request_id="n2", reply_subject="api.x", prompt_token_ids=[10, 11, 12], n=2,
        params=SamplingParams(max_tokens=20, ignore_eos=True, stop=["!"])), Admission,
        timeout=5)
    await _until(lambda: sum(bool(i.finish_reason) for i in _items(detokenizer.batches, "n2"))
                 == 2, "both completions ended")
    await detokenizer.stop()
    items = _items(detokenizer.batches, "n2")
    assert len(items) > 4  # several updates per completion
    for index in (0, 1):
        mine = [i for i in items if i.index == index]
        assert [t for i in mine for t in i.new_token_ids] == [7] * 20
        assert [i.start is not None for i in mine] == [True] + [False] * (len(mine) - 1)
        assert (mine[0].start.reply_subject, mine[0].start.stop) == ("api.x", ["!"])


@pytest.mark.asyncio
async def test_a_completion_its_detokenizer_copy_cannot_decode_ends_with_an_error(engine):
    """The copy reports a completion it never got the start of: the engine ends it with an
    error, sent with the start; for one that ended meanwhile, the engine sends that error."""
    runtime, executor, _, service = engine
    detokenizer = FakeDetokenizer("d1")
    await detokenizer.start(runtime, service)
    report = subjects.engine_unknown_completion(ENGINE)
    executor.max_answered = executor.num_answered + 1  # its prefill, then it waits
    await _submit(runtime, "long", max_tokens=50)
    await _until(lambda: _items(detokenizer.batches, "long"), "long's first tokens")
    await runtime.publish(report, UnknownCompletion(request_id="long", instance_id="d1"))
    await _until(lambda: not service.scheduler.table.holds("long"), "long ended there")
    executor.max_answered = None
    await _until(lambda: any(i.finish_reason for i in _items(detokenizer.batches, "long")),
                 "long's end went out")
    last = _items(detokenizer.batches, "long")[-1]
    assert (last.finish_reason, last.start.reply_subject) == (FinishReason.ERROR, "api.x")
    assert "never got this completion's start" in last.error
    assert last.start.replay_token_ids == []  # its text never reached the client
    assert sum(len(i.new_token_ids) for i in _items(detokenizer.batches, "long")) < 50

    await _submit(runtime, "short", max_tokens=2)
    await _until(lambda: any(i.finish_reason for i in _items(detokenizer.batches, "short")),
                 "short finished")
    await runtime.publish(report, UnknownCompletion(request_id="short", instance_id="d1"))
    await _until(lambda: _items(detokenizer.batches, "short")[-1].finish_reason
                 == FinishReason.ERROR, "short's error")
    late = _items(detokenizer.batches, "short")[-1]
    assert late.start.reply_subject == "api.x" and late.new_token_ids == []
    await detokenizer.stop()


@pytest.mark.asyncio
async def test_a_request_avoids_the_detokenizer_copies_its_api_took_for_dead(engine):
    """Both copies beat here, but the api that sent these requests took d1 for dead (its view
    and this engine's may differ by seconds): none of their tokens goes to d1, though the
    copies' hashing would send each of them there."""
    runtime, _, _, service = engine
    copies = [FakeDetokenizer("d1"), FakeDetokenizer("d2")]
    for copy in copies:
        await copy.start(runtime, service)
    await _until(lambda: len(service.detokenizers.liveness.alive(time.monotonic())) == 2,
                 "the scheduler heard both copies")
    ids = [i for i in (f"a{n}" for n in range(40))
           if preferred_copy((i, 0), {"d1", "d2"}) == "d1"][:4]
    for request_id in ids:
        await runtime.request(subjects.engine_submit(ENGINE), SubmitRequest(
            request_id=request_id, reply_subject="api.x", prompt_token_ids=[10, 11, 12],
            params=SamplingParams(max_tokens=3, ignore_eos=True),
            avoid_detokenizer_ids=["d1"]), Admission, timeout=5)
    await _until(lambda: all(any(i.finish_reason for i in _items(copies[1].batches, r))
                             for r in ids), "every request ended on d2")
    for copy in copies:
        await copy.stop()
    assert not any(_items(copies[0].batches, r) for r in ids)

"""Handlers that run concurrently (`ServiceRuntime.on_message(..., concurrency=N)`) on a real
nats-server: the bound, close() draining or cancelling them, and the tokenizer's admissions,
which must not wait behind one engine slow to answer."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import (
    AbortRequest,
    Admission,
    GenerateRequest,
    Heartbeat,
    Ping,
    SamplingParams,
    SubmitRequest,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.tokenizer.router import Router
from llmbus.services.tokenizer.service import TokenizerService
from llmbus.services.tokenizer.tokenization import Tokenization
from tests.gguf_fixtures import tiny_tokenizer

pytestmark = pytest.mark.adapter  # a real nats-server, no model

TIMEOUT = 30.0  # a busy 2-core box; every wait below is on a condition


async def _until(condition) -> None:
    async with asyncio.timeout(TIMEOUT):
        while not condition():
            await asyncio.sleep(0.01)


class Stalling:
    """A request handler that records which requests started and holds each until released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.release = {name: asyncio.Event() for name in "abc"}

    def release_all(self) -> None:
        for event in self.release.values():
            event.set()

    async def __call__(self, request: AbortRequest, _) -> AbortRequest:
        name = request.request_id
        self.started.append(name)
        try:
            await self.release[name].wait()
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise
        return request


async def _until_unsubscribed(client, subject: str) -> None:
    async with asyncio.timeout(TIMEOUT):
        while True:
            try:
                await client.request(subject, encode(Ping()), timeout=TIMEOUT)
            except nats.errors.NoRespondersError:
                return


async def _request(client, subject: str, message: AbortRequest):
    """A request, sent again while the server answers "no responders": seen here about once in
    ten runs right after the handler subscribed and flushed (already before the handlers
    became concurrent), with every request of the burst refused, so none reached it."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            try:
                return await client.request(subject, encode(message), timeout=TIMEOUT)
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)


def _name(reply) -> str:
    return decode(reply.data, AbortRequest).request_id


async def _send_three(url: str, client, stalling: Stalling):
    """A runtime with `stalling` at concurrency 2, and three requests to it; returns once two
    handlers run and the third message is in its callback, waiting for a slot."""
    runtime = ServiceRuntime("test", url, handle_signals=False)
    await runtime.connect()
    await runtime.on_request("test.stall", AbortRequest, stalling, concurrency=2)
    subscription = runtime._subscriptions[-1]
    replies = [asyncio.create_task(_request(client, "test.stall", AbortRequest(name)))
               for name in "abc"]
    # delivered and off the queue: the third callback waits for a slot
    await _until(lambda: subscription.delivered == 3 and subscription.pending_msgs == 0)
    await _until(lambda: len(stalling.started) >= 2)
    return runtime, replies


@pytest.mark.asyncio
async def test_with_concurrency_two_a_third_message_waits_until_a_handler_finishes(bus):
    url, client = bus
    stalling = Stalling()
    runtime, replies = await _send_three(url, client, stalling)
    assert len(stalling.started) == 2
    first = stalling.started[0]
    stalling.release[first].set()
    assert _name(await replies["abc".index(first)]) == first
    await _until(lambda: len(stalling.started) == 3)
    stalling.release_all()
    assert sorted(map(_name, await asyncio.gather(*replies))) == ["a", "b", "c"]
    await runtime.close()
    assert stalling.cancelled == [] and runtime._handler_tasks == set()


@pytest.mark.asyncio
async def test_close_lets_in_flight_and_waiting_handlers_answer(bus):
    url, client = bus
    stalling = Stalling()
    runtime, replies = await _send_three(url, client, stalling)
    closing = asyncio.create_task(runtime.close())
    await _until_unsubscribed(client, subjects.ping("test"))  # close() stopped taking messages
    stalling.release_all()  # released while close() drains: the replies still go out
    assert sorted(map(_name, await asyncio.gather(*replies))) == ["a", "b", "c"]
    await asyncio.wait_for(closing, TIMEOUT)
    assert stalling.cancelled == [] and runtime._handler_tasks == set()
    assert runtime.nc.is_closed


@pytest.mark.asyncio
async def test_close_cancels_the_handlers_still_running_after_its_timeout(bus):
    url, client = bus
    stalling = Stalling()
    runtime, replies = await _send_three(url, client, stalling)
    runtime.drain_timeout = 0.3  # none of the three is ever released
    await asyncio.wait_for(runtime.close(), TIMEOUT)
    for reply in replies:  # never answered
        reply.cancel()
    assert sorted(stalling.cancelled) == sorted(stalling.started)
    assert len(stalling.started) == 2  # the third was dropped, never started
    assert runtime._handler_tasks == set() and runtime.nc.is_closed


@pytest.mark.asyncio
async def test_an_engine_slow_to_admit_holds_up_no_admission_to_another_engine(bus):
    """Request r1 goes to engine e0, which holds its answer until r2 is admitted by e1; r2 goes
    through the same tokenizer copy. Handled one after the other, r2 would wait for r1 until
    the tokenizer gave up on e0 (ADMISSION_TIMEOUT) and moved r1 to e1."""
    url, client = bus
    e0_has_r1 = asyncio.Event()
    r2_admitted = asyncio.Event()

    def engine(engine_id: str):
        async def on_submit(msg) -> None:
            request_id = decode(msg.data, SubmitRequest).request_id
            if (engine_id, request_id) == ("e0", "r1"):
                e0_has_r1.set()
                await r2_admitted.wait()
            await msg.respond(encode(Admission(scheduler_instance_id=engine_id)))
            if request_id == "r2":
                r2_admitted.set()

        return on_submit

    router = Router()
    router.liveness.dead_after = 1e9  # the test's engines send no heartbeats
    for engine_id in ("e0", "e1"):
        await client.subscribe(subjects.engine_submit(engine_id), cb=engine(engine_id))
        router.on_heartbeat(Heartbeat(service="scheduler", instance_id=engine_id,
                                      engine_id=engine_id, num_free_blocks=100,
                                      num_total_blocks=100, block_size=4), time.monotonic())
    await client.flush()

    async def admit(request_id: str, prompt: str) -> Admission:
        reply = await client.request(subjects.TOKENIZER_GENERATE, encode(GenerateRequest(
            request_id=request_id, reply_subject="api.x", model="m", params=SamplingParams(),
            prompt=prompt)), timeout=TIMEOUT)
        return decode(reply.data, Admission)

    async with ServiceRuntime("tokenizer", url, handle_signals=False) as runtime:
        await TokenizerService(runtime, Tokenization(tiny_tokenizer()), router).subscribe()
        first = asyncio.create_task(admit("r1", "hello"))  # the least loaded engine: e0
        await asyncio.wait_for(e0_has_r1.wait(), TIMEOUT)
        second = await admit("r2", "world")  # e0 has one routed to it now: e1
        assert second.scheduler_instance_id == "e1"
        assert (await first).scheduler_instance_id == "e0"  # e0's own answer, not a move

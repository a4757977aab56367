"""Liveness and cache-aware routing: the pure parts, alone (the detokenizer routing:
test_detokenizer_routing.py); and a slow engine told to withdraw, on a real nats-server."""

from __future__ import annotations

import pytest

from llmbus.bus import subjects
from llmbus.bus.block_hash import block_hashes
from llmbus.bus.liveness import DEAD_AFTER, Liveness
from llmbus.bus.messages import CacheEvent, Heartbeat, SamplingParams
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.scheduler import Scheduler
from llmbus.services.tokenizer.router import BALANCE_SLACK, Router

pytestmark = pytest.mark.adapter  # a real nats-server, no model


def beat(instance: str, running: int = 0, service: str = "scheduler") -> Heartbeat:
    return Heartbeat(service=service, instance_id=instance, engine_id=instance,
                     num_running=running, num_free_blocks=100, num_total_blocks=100,
                     block_size=4)


def test_liveness_reaps_silent_copies_once():
    live = Liveness(dead_after=2.0)
    assert live.seen(beat("a"), now=0.0) and not live.seen(beat("a"), now=1.0)
    live.seen(beat("b"), now=1.5)
    assert [h.instance_id for h in live.alive(3.2)] == ["b"]
    assert [h.instance_id for h in live.reap(3.2)] == ["a"]
    assert live.reap(3.2) == []
    assert live.seen(beat("a"), now=4.0)  # back: new again


def test_a_silence_of_every_copy_at_once_is_pardoned_by_the_first_heartbeat_after_it():
    """The watcher's server was cut off from the cluster for 10 s: when it is back, api copy
    a's heartbeat comes a moment before b's, and b must not be reaped in between."""
    live = Liveness(dead_after=2.0)
    live.seen(beat("a", service="api"), now=0.0)
    live.seen(beat("b", service="api"), now=0.1)
    live.seen(beat("a", service="api"), now=10.0)
    assert live.reap(10.0) == [] and len(live.alive(10.0)) == 2
    live.seen(beat("a", service="api"), now=11.0)
    assert [h.instance_id for h in live.reap(12.5)] == ["b"]  # b really gone: reaped later


def test_a_copy_killed_and_started_again_before_it_was_missed_is_reaped_once():
    """d2 killed and started again within dead_after under the same instance id: its new
    start (another incarnation) is reaped once as the copy that died, so what that one held
    is recovered, and the new one stays counted."""
    live = Liveness(dead_after=6.0)
    old = Heartbeat(service="detokenizer", instance_id="d2", incarnation="a")
    live.seen(old, now=0.0)
    live.seen(Heartbeat(service="detokenizer", instance_id="d2", incarnation="a"), now=0.5)
    assert live.reap(1.0) == []
    live.seen(Heartbeat(service="detokenizer", instance_id="d2", incarnation="b"), now=4.0)
    assert live.reap(4.0) == [old] and live.reap(4.5) == []
    assert [h.incarnation for h in live.alive(4.5)] == ["b"]


def test_engine_tree_hashes_equal_router_hashes():
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4, max_model_len=64))
    prompt = list(range(100, 113))
    s.add_request("a", "api", prompt, SamplingParams(max_tokens=1))
    plan = s.schedule()
    stored, removed = s.kv.tree.take_events()
    assert stored == block_hashes(prompt, 4) and removed == []
    assert len(plan.scheduled) == 1


def test_router_follows_the_cache_then_balances_load():
    router = Router()
    for name in ("e0", "e1"):
        router.on_heartbeat(beat(name), now=0.0)
    shared = list(range(1000, 1064))  # 16 blocks of 4
    first = router.choose(shared + [1, 2], now=0.1)
    # The router counts the prompt as cached on its engine at once: the next one follows.
    assert router.choose(shared + [7, 8], now=0.2).instance_id == first.instance_id
    other = "e1" if first.instance_id == "e0" else "e0"
    # A prompt no engine holds goes to the less loaded one: `first` has two requests routed.
    assert router.choose(list(range(5000, 5064)), now=0.3).instance_id == other
    # Cache events from the other engine win prompts it holds.
    router.on_cache_event(other, CacheEvent(engine_id=other,
                                            stored=block_hashes(list(range(7000, 7064)), 4)))
    assert router.choose(list(range(7000, 7070)), now=0.4).instance_id == other
    # Too busy: load wins over cache.
    router.on_heartbeat(beat(first.instance_id, running=BALANCE_SLACK + 5), now=0.5)
    router.on_heartbeat(beat(other), now=0.5)
    assert router.choose(shared + [9], now=0.6).instance_id == other


def test_router_skips_dead_and_excluded_engines():
    router = Router()
    router.on_heartbeat(beat("e0"), now=0.0)
    now = DEAD_AFTER + 0.5  # e0 silent for longer than DEAD_AFTER, e1 heard just now
    router.on_heartbeat(beat("e1"), now=now)
    assert router.choose([1, 2, 3, 4], now=now).instance_id == "e1"
    assert router.choose([1, 2, 3, 4], now=now, exclude=frozenset({"e1"})) is None
    assert [h.instance_id for h in router.forget_dead(now)] == ["e0"]


async def _submit_to_e0_or_e1(runtime, request_id: str, e1_running: int = 0):
    """A submit routed between engines e0 and e1 (heard from; e1 with `e1_running` requests),
    each given 0.3 s to answer."""
    from llmbus.bus.messages import SubmitRequest
    from llmbus.services.tokenizer.service import submit_to_an_engine

    router = Router()
    router.on_heartbeat(beat("e0"), now=0.0)
    router.on_heartbeat(beat("e1", running=e1_running), now=0.0)
    router.liveness.dead_after = 1e9  # the test's clock is not the router's
    submit = SubmitRequest(request_id=request_id, reply_subject="api",
                           prompt_token_ids=[1, 2, 3], params=SamplingParams())
    return await submit_to_an_engine(runtime, router, submit, timeout=0.3)


async def test_an_engine_too_slow_to_admit_is_told_to_withdraw():
    """The chosen engine does not answer the submit in time: the request goes to the other
    engine, and the slow one is told to withdraw it (it may admit it later, when it wakes),
    so that it never runs twice. Real nats-server; the two engines are plain subscribers."""
    import asyncio

    import nats

    from llmbus.bus.codec import decode, encode
    from llmbus.bus.messages import AbortRequest, Admission
    from llmbus.bus.runtime import ServiceRuntime
    from llmbus.services.launcher import Stack

    stack = Stack()
    try:
        url = stack.start_nats(auth=False)
        engines = await nats.connect(url)
        withdrawn = []

        async def slow(msg) -> None:
            await asyncio.sleep(1.0)  # stalled past the router's patience
            await msg.respond(encode(Admission(scheduler_instance_id="slow")))

        async def fast(msg) -> None:
            await msg.respond(encode(Admission(scheduler_instance_id="fast")))

        async def on_withdraw(msg) -> None:
            withdrawn.append(decode(msg.data, AbortRequest).request_id)

        await engines.subscribe(subjects.engine_submit("e0"), cb=slow)
        await engines.subscribe(subjects.engine_submit("e1"), cb=fast)
        await engines.subscribe(subjects.engine_withdraw("e0"), cb=on_withdraw)
        await engines.subscribe(subjects.engine_withdraw("e1"), cb=on_withdraw)
        await engines.flush()
        runtime = ServiceRuntime("tokenizer", url)
        await runtime.connect()
        admission = await _submit_to_e0_or_e1(runtime, "req-1", e1_running=3)  # e0 first
        assert admission.scheduler_instance_id == "fast"
        for _ in range(50):
            if withdrawn:
                break
            await asyncio.sleep(0.05)
        assert withdrawn == ["req-1"]  # told to e0 only
        await runtime.close()
        await engines.close()
    finally:
        stack.stop()


async def test_when_every_engine_was_too_slow_the_request_is_a_503_not_a_refusal():
    """Both engines stall past the router's patience (a cluster settling): each is told to
    withdraw the attempt, and the answer is "no engine is available" (a 503 a client
    retries), not a last try on the any-engine subject, where an engine that has withdrawn
    the attempt refuses it as "withdrawn (admitted elsewhere)", a 400."""
    import asyncio

    import nats

    from llmbus.bus.codec import decode, encode
    from llmbus.bus.messages import AbortRequest, Admission, ErrorCode
    from llmbus.bus.runtime import ServiceRuntime
    from llmbus.services.launcher import Stack

    stack = Stack()
    try:
        url = stack.start_nats(auth=False)
        engines = await nats.connect(url)
        withdrawn: list[str] = []
        anywhere: list[str] = []

        async def slow(msg) -> None:
            await asyncio.sleep(1.0)
            await msg.respond(encode(Admission(scheduler_instance_id="slow")))

        async def any_engine(msg) -> None:  # an engine that withdrew it refuses it here
            anywhere.append("tried")
            await msg.respond(encode(Admission(error_code=ErrorCode.INVALID_REQUEST,
                                               error_message="withdrawn")))

        async def on_withdraw(msg) -> None:
            withdrawn.append(decode(msg.data, AbortRequest).request_id)

        for engine in ("e0", "e1"):
            await engines.subscribe(subjects.engine_submit(engine), cb=slow)
            await engines.subscribe(subjects.engine_withdraw(engine), cb=on_withdraw)
        await engines.subscribe(subjects.ENGINE_SUBMIT, cb=any_engine)
        await engines.flush()
        runtime = ServiceRuntime("tokenizer", url)
        await runtime.connect()
        admission = await _submit_to_e0_or_e1(runtime, "req-2")
        assert admission.error_code == ErrorCode.OVERLOADED and anywhere == []
        for _ in range(50):
            if len(withdrawn) == 2:
                break
            await asyncio.sleep(0.05)
        assert withdrawn == ["req-2", "req-2"]
        await runtime.close()
        await engines.close()
    finally:
        stack.stop()

"""Services on a three-server NATS cluster, with the per-service users of `llmbus up`: a copy
whose server dies reconnects to another one it learned from the cluster, keeps its
subscriptions and its private inbox, and no watcher takes it, or anyone, for dead meanwhile;
also not while the watcher's own server hangs (no RST)."""

from __future__ import annotations

import asyncio
import signal
import time

import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.liveness import DEAD_AFTER
from llmbus.bus.messages import DeltaBatch, Heartbeat, ModelInfo, ModelInfoRequest, TextDelta
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.launcher import Stack

pytestmark = pytest.mark.adapter  # a real nats-server, no model

TIMEOUT = 20.0  # seconds for what takes well under one


@pytest.fixture
def cluster():
    stack = Stack()
    urls = stack.start_nats_cluster(3)
    yield stack, urls
    for child in stack.children:  # a paused server must be able to stop
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGCONT)
    stack.stop()


def _server(stack: Stack, index: int):
    [child] = [c for c in stack.children if c.name == f"nats.{index}"]
    return child.process


def _as(stack: Stack, user: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBUS_NATS_USER", user)
    monkeypatch.setenv("LLMBUS_NATS_PASSWORD", stack.passwords[user])


async def _connect(stack: Stack, user: str, url: str) -> nats.aio.client.Client:
    return await nats.connect(url, user=user, password=stack.passwords[user],
                              inbox_prefix=subjects.inbox_prefix(user))


async def _until(condition, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout} s: {what}")
        await asyncio.sleep(0.05)


async def test_a_copy_whose_server_dies_keeps_its_subscriptions_and_inbox(cluster, monkeypatch):
    stack, urls = cluster
    _as(stack, "api", monkeypatch)
    scheduler = await _connect(stack, "scheduler", urls[1])
    detokenizer = await _connect(stack, "detokenizer", urls[2])

    async def answer(msg) -> None:
        decode(msg.data, ModelInfoRequest)
        await msg.respond(encode(ModelInfo(model_name="m", max_model_len=8, engine_id="e0")))

    await scheduler.subscribe(subjects.ENGINE_MODEL, cb=answer)
    await scheduler.flush()
    received: list[str] = []
    # Given one server only: the others it learns from the cluster.
    async with ServiceRuntime("api", urls[0], handle_signals=False) as runtime:
        async def on_deltas(batch: DeltaBatch, _) -> None:
            received.extend(d.text for d in batch.items)

        await runtime.on_message(subjects.api_deltas(runtime.instance_id), DeltaBatch,
                                 on_deltas)
        await _until(lambda: len(runtime.nc.discovered_servers) >= 2, "servers discovered")

        async def round_trip(text: str) -> None:
            """A request answered on another server (the reply comes to this copy's own
            inbox), and a message published to its subscription from another server."""
            info = await runtime.request(subjects.ENGINE_MODEL, ModelInfoRequest(), ModelInfo,
                                         timeout=TIMEOUT)
            assert info.engine_id == "e0"
            deadline = time.monotonic() + TIMEOUT
            while text not in received:  # until the route has this copy's interest
                assert time.monotonic() < deadline, f"{text!r} never arrived: {received}"
                await detokenizer.publish(subjects.api_deltas(runtime.instance_id), encode(
                    DeltaBatch(items=[TextDelta(request_id="r", text=text)])))
                await asyncio.sleep(0.1)

        await round_trip("before")
        _server(stack, 0).send_signal(signal.SIGKILL)
        await _until(lambda: runtime.num_reconnects == 1, "reconnected to another server")
        assert runtime.nc.connected_url.port != int(urls[0].rsplit(":", 1)[1])
        await round_trip("after")
    await scheduler.close()
    await detokenizer.close()


async def test_liveness_tolerates_reconnects_of_the_copy_and_of_its_watcher(cluster,
                                                                          monkeypatch):
    """A detokenizer copy on server 0 heartbeats; the api watches it from server 1, a plain
    client on server 2 times its heartbeats. Server 0 is killed (the copy reconnects), then
    server 1 is paused (the api's connection hangs with no RST until its pings go
    unanswered). The api never counts the copy dead, and the copy's longest silence, its own
    reconnects included, is shorter than DEAD_AFTER."""
    stack, urls = cluster
    arrivals: list[float] = []
    timer = await nats.connect(urls[2], user="observer", password=stack.passwords["observer"])

    async def on_heartbeat(msg) -> None:
        if decode(msg.data, Heartbeat).service == "detokenizer":
            arrivals.append(time.monotonic())

    await timer.subscribe(subjects.heartbeat("detokenizer"), cb=on_heartbeat)
    await timer.flush()
    _as(stack, "detokenizer", monkeypatch)
    copy = ServiceRuntime("detokenizer", urls[0], handle_signals=False)
    await copy.connect()
    copy.mark_ready()
    _as(stack, "api", monkeypatch)
    api = ServiceRuntime("api", urls[1], handle_signals=False)
    await api.connect()
    watcher = EngineClient(api, request_timeout=60)
    # Shorter than the api's own hang lasts (2-3 s): only ServiceRuntime.bus_time, which does
    # not count the silence the api's own connection causes, keeps the copy counted.
    watcher.stats.copies["detokenizer"].dead_after = 1.5
    await watcher.start()
    try:
        def counted() -> bool:
            return watcher.stats.num_copies()["detokenizer"] == 1

        await _until(counted, "the api sees the copy")
        await _until(lambda: len(api.nc.discovered_servers) >= 2, "servers discovered")
        _server(stack, 0).send_signal(signal.SIGKILL)
        await _watch(counted, lambda: copy.num_reconnects >= 1, "the copy reconnected")
        if api.num_reconnects == 0:  # the api is still on server 1: pause it
            paused = _server(stack, 1)
        else:  # it moved too (to server 1 or 2): pause the one it is on now
            paused = _server(stack, 1 if api.nc.connected_url.port == int(
                urls[1].rsplit(":", 1)[1]) else 2)
        reconnects = api.num_reconnects
        paused.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        await _watch(counted, lambda: api.num_reconnects > reconnects, "the api reconnected")
        noticed = time.monotonic() - started
        paused.send_signal(signal.SIGCONT)
        await _watch(counted, lambda: time.monotonic() - started > noticed + DEAD_AFTER,
                     "a while after the api reconnected")
    finally:
        await api.close()
        await copy.close()
        await timer.close()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    print(f"api's hung connection noticed after {noticed:.1f} s; the copy's longest silence "
          f"at a third server: {max(gaps):.2f} s (DEAD_AFTER {DEAD_AFTER} s)")
    assert max(gaps) < DEAD_AFTER


async def _watch(holds, done, what: str) -> None:
    """Until `done()`, `holds()` is true every time it is looked at."""
    deadline = time.monotonic() + TIMEOUT
    while not done():
        assert holds(), f"before {what}: the api took the copy for dead"
        assert time.monotonic() < deadline, f"after {TIMEOUT} s: not {what}"
        await asyncio.sleep(0.05)
    assert holds(), f"when {what}: the api took the copy for dead"


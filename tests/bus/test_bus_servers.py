"""`--nats-url` as a list of a cluster's servers: parsed and refused by `server_urls`, and a
service given a list whose first server is down still joins the bus through another, on a real
nats-server."""

from __future__ import annotations

import random

import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import Ping, Pong
from llmbus.bus.runtime import ServiceRuntime
from llmbus.bus.servers import (
    STUCK_CLOSE_SECONDS,
    StuckClose,
    connect_order,
    server_urls,
    tls_options,
)
from llmbus.services.launcher import free_port

pytestmark = pytest.mark.adapter  # a real nats-server, no model

TIMEOUT = 30.0  # a busy 2-core box


def test_a_list_names_each_server_and_one_url_is_a_list_of_one():
    assert server_urls("nats://a:4222") == ["nats://a:4222"]
    assert server_urls("nats://a:1, nats://b:2,nats://c:3") == [
        "nats://a:1", "nats://b:2", "nats://c:3"]
    assert "tls" in tls_options("tls://a:1,tls://b:2") and tls_options("nats://a:1") == {}


def test_copies_keep_the_first_server_and_spread_over_the_others():
    """Each copy tries the user's first server first; the fallbacks come in an order of its
    own, so copies that lose the same server do not all move to the same next one."""
    urls = [f"nats://h{i}:4222" for i in range(4)]
    orders = [connect_order(urls, random.Random(seed)) for seed in range(40)]
    assert all(order[0] == urls[0] and sorted(order) == sorted(urls) for order in orders)
    assert {order[1] for order in orders} == set(urls[1:])  # every fallback comes first somewhere
    assert urls == [f"nats://h{i}:4222" for i in range(4)]  # the caller's list is left alone
    assert connect_order(urls[:1]) == urls[:1]


@pytest.mark.parametrize(("url", "says"), [
    ("nats://a:1,,nats://b:2", "an empty server"),
    ("tls://a:1,nats://b:2", "every server tls://, or none"),
])
def test_a_bad_list_is_refused_saying_why(url, says):
    with pytest.raises(ValueError, match=says):
        server_urls(url)


async def test_a_service_joins_through_a_server_of_the_list_that_is_up(bus):
    url, client = bus
    down = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    runtime = ServiceRuntime("servers-test", f"{down},{url}", handle_signals=False)
    await runtime.connect()
    try:
        assert runtime.nc is not None and runtime.nc.connected_url is not None
        reply = await client.request(subjects.ping("servers-test"), encode(Ping()),
                                     timeout=TIMEOUT)
        assert decode(reply.data, Pong).instance_id == runtime.instance_id
    finally:
        await runtime.close()


class _Transport:  # what StuckClose reads of nats-py's: a stream writer's asyncio transport
    def __init__(self, closing: bool) -> None:
        self.closing, self.aborted = closing, False

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.aborted = True


class _Writer:
    def __init__(self, closing: bool) -> None:
        self.transport = _Transport(closing)


class _Client:
    def __init__(self, writer: _Writer, reconnecting: bool = True) -> None:
        self.is_reconnecting = reconnecting
        self._transport = type("TcpTransport", (), {})()
        self._transport._io_writer = self._transport._bare_io_writer = writer


def test_a_close_that_hangs_past_its_time_is_cut_short_and_nothing_else_is():
    """nats-py closes a lost TLS connection gracefully before it reconnects, which waits for
    TCP to give up when the server was cut off (30 s seen): StuckClose drops it once its close
    has taken STUCK_CLOSE_SECONDS. A connection being made (not closing) is never dropped, nor
    one of a client that is not reconnecting."""
    watch, hung = StuckClose(), _Writer(closing=True)
    client = _Client(hung)
    assert not watch.check(client, 100.0)  # the reconnection began
    assert not watch.check(client, 100.0 + STUCK_CLOSE_SECONDS - 0.1)
    assert not hung.transport.aborted
    assert watch.check(client, 100.0 + STUCK_CLOSE_SECONDS + 0.1)
    assert hung.transport.aborted
    connecting = _Writer(closing=False)  # the next server's connection, being made
    client._transport._io_writer = connecting
    for now in (103.0, 110.0, 200.0):
        assert not watch.check(client, now)
    assert not connecting.transport.aborted
    calm, calm_watch = _Client(_Writer(closing=True), reconnecting=False), StuckClose()
    assert not any(calm_watch.check(calm, now) for now in (0.0, 10.0, 100.0))

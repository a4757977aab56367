"""The api's stored responses in JetStream's key-value store (services/api/response_store_bus.py),
on real nats-servers started as `llmbus up` starts them (JetStream on, one user per service):
what the api stores any copy reads, also after reconnecting and from a new connection; the
bucket's TTL removes values; no other bus user reaches the bucket; ids from URLs never become
wildcards or other subjects."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from llmbus.bus import subjects
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.api import response_store_bus
from llmbus.services.api.response_store_bus import ResponseStore, ResponseStoreUnavailable
from llmbus.services.launcher import Stack, wait_for_port
from llmbus.services.nats_auth import PERMISSIONS
from tests.bus_users import (
    ConnectAs,
    connect_as,
    nats_server,
    refusals,
    without_jetstream,
)

pytestmark = pytest.mark.adapter  # a real nats-server, no model

TTL_S, MAX_BYTES = 3600.0, 64 * 2**20
TIMEOUT = 15.0  # seconds for what takes well under one (or, for the TTL, about one)


# One for the tests that can share it; one of a test's own, where the bucket must not exist
# yet or the server is killed.
server = pytest.fixture(nats_server, scope="module", name="server")
fresh_server = pytest.fixture(nats_server, name="fresh_server")


@pytest.fixture
def as_user(monkeypatch) -> ConnectAs:
    return connect_as(monkeypatch)


async def _open(runtime: ServiceRuntime, ttl_s: float = TTL_S) -> ResponseStore:
    return await ResponseStore.open(runtime, ttl_s=ttl_s, max_bytes=MAX_BYTES)


async def _until(condition: Callable, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {TIMEOUT} s: {what}")
        await asyncio.sleep(0.1)


def _response_id(n: int) -> str:
    return f"resp_{n:032x}"


async def test_the_api_puts_gets_and_deletes(server, as_user):
    """As the api user, with its real permissions: a value (up to the bus's max_payload) reads
    back as it was stored; deleting it leaves nothing, and a second delete says so."""
    async with as_user(*server, "api") as runtime:
        store = await _open(runtime)
        await store.put(_response_id(1), b'{"id": "resp_1"}')
        assert await store.get(_response_id(1)) == b'{"id": "resp_1"}'
        await store.put(_response_id(1), b"replaced")
        assert await store.get(_response_id(1)) == b"replaced"
        assert await store.get(_response_id(2)) is None
        largest = bytes(range(256)) * (runtime.nc.max_payload // 256)
        await store.put(_response_id(3), largest)
        assert await store.get(_response_id(3)) == largest
        assert await store.delete(_response_id(1)) is True
        assert await store.get(_response_id(1)) is None
        assert await store.delete(_response_id(1)) is False
        assert await store.delete(_response_id(2)) is False


async def test_a_value_over_max_payload_is_refused_by_name(server, as_user):
    async with as_user(*server, "api") as runtime:
        store = await _open(runtime)
        limit = runtime.nc.max_payload
        with pytest.raises(ValueError, match=f"{limit + 1} bytes .* limit of {limit} bytes"):
            await store.put(_response_id(4), b"x" * (limit + 1))
        assert await store.get(_response_id(4)) is None


@pytest.mark.parametrize("response_id", [
    "resp_1.x", "resp_*", "resp_>", "*", ">", "resp_1 x", "", "resp_\u00e9", "r" * 201])
async def test_ids_a_key_cannot_hold_are_refused(server, as_user, response_id):
    """Ids come from URLs: one with a dot, a wildcard, a space, ... reads nothing, deletes
    nothing and stores nothing, instead of reaching other keys or subjects."""
    async with as_user(*server, "api") as runtime:
        store = await _open(runtime)
        await store.put(_response_id(5), b"kept")
        assert await store.get(response_id) is None
        assert await store.delete(response_id) is False
        with pytest.raises(ValueError, match="response id"):
            await store.put(response_id, b"x")
        assert await store.get(_response_id(5)) == b"kept"


async def test_two_copies_opening_at_once_share_one_bucket(fresh_server, as_user):
    async with as_user(*fresh_server, "api") as first, as_user(*fresh_server, "api") as second:
        one, other = await asyncio.gather(_open(first), _open(second))
        await one.put(_response_id(6), b"from one copy")
        assert await other.get(_response_id(6)) == b"from one copy"


async def test_the_bucket_ttl_removes_a_value(fresh_server, as_user):
    async with as_user(*fresh_server, "api") as runtime:
        store = await _open(runtime, ttl_s=1.0)
        await store.put(_response_id(7), b"short-lived")
        assert await store.get(_response_id(7)) == b"short-lived"

        async def gone() -> bool:
            return await store.get(_response_id(7)) is None

        await _until(gone, "the value outlived the bucket's TTL of 1 s")


async def test_values_survive_a_reconnect_and_a_new_open(fresh_server, as_user):
    """The api's server is killed and started again on its store: the copy reconnects and
    reads what it stored, and so does a store opened afresh (a new process's view)."""
    stack, url = fresh_server
    [child] = stack.children
    again = None
    try:
        async with as_user(stack, url, "api") as runtime:
            store = await _open(runtime)
            await store.put(_response_id(8), b"durable")
            child.process.send_signal(signal.SIGKILL)
            child.process.wait()
            again = subprocess.Popen(child.process.args, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
            assert wait_for_port("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=TIMEOUT)

            async def reconnected() -> bool:
                return runtime.num_reconnects == 1

            await _until(reconnected, "the api reconnected")
            assert await store.get(_response_id(8)) == b"durable"
            async with as_user(stack, url, "api") as newcomer:
                assert await (await _open(newcomer)).get(_response_id(8)) == b"durable"
    finally:  # after the copies have closed (else they wait for a drain)
        if again is not None:
            again.terminate()
            again.wait(10)


async def test_an_existing_bucket_with_other_limits_is_kept_with_a_warning(server, as_user):
    async with as_user(*server, "api") as runtime:
        await _open(runtime)
        with capture_logs() as logs:
            store = await _open(runtime, ttl_s=2 * TTL_S)
        [warning] = [e for e in logs if e["log_level"] == "warning"]
        assert (warning["ttl_s"], warning["wanted_ttl_s"]) == (TTL_S, 2 * TTL_S)
        assert warning["max_bytes"] == warning["wanted_max_bytes"] == MAX_BYTES
        await store.put(_response_id(9), b"still works")
        assert await store.get(_response_id(9)) == b"still works"


@pytest.mark.parametrize("user", [u for u in PERMISSIONS if u != "api"])
async def test_no_other_bus_user_reaches_the_bucket(server, user):
    """Every JetStream subject the api's store uses is a permissions violation for the
    other users (the server refuses the publish; the request itself goes unanswered)."""
    key = subjects.kv_key(subjects.RESPONSES_BUCKET, _response_id(1))
    used = [subjects.js_stream_api(verb, subjects.RESPONSES_STREAM)
            for verb in ("STREAM.INFO", "STREAM.CREATE", "STREAM.MSG.GET")]
    used += [f"{subjects.js_stream_api('DIRECT.GET', subjects.RESPONSES_STREAM)}.{key}", key]
    errors = await refusals(*server, user, used)
    assert len(errors) == len(used), errors
    assert all("permissions violation for publish" in e for e in errors), errors


async def test_the_tokenizer_cannot_open_the_store(server, as_user, monkeypatch):
    monkeypatch.setattr(response_store_bus, "REQUEST_TIMEOUT", 0.5)
    monkeypatch.setattr(response_store_bus, "OPEN_TIMEOUT", 0.0)
    async with as_user(*server, "tokenizer") as runtime:
        # after the refusal nats-py may reconnect (seen: a PONG it could not match), and
        # closing would wait out a drain for nothing
        runtime.drain_timeout = 0.5
        with pytest.raises(ResponseStoreUnavailable, match="may this bus user use the bucket"):
            await _open(runtime)


async def test_a_server_without_jetstream_makes_the_store_unavailable(monkeypatch):
    async with without_jetstream(monkeypatch) as runtime:
        with pytest.raises(ResponseStoreUnavailable, match="no JetStream.*llmbus up"):
            await _open(runtime)


async def test_a_cluster_keeps_the_bucket_on_every_server(as_user):
    """The launcher's three servers form one JetStream cluster: a bucket of 3 replicas, written
    through one server, reads back through another."""
    stack = Stack()
    urls = stack.start_nats_cluster(3)
    try:
        async with as_user(stack, urls[0], "api") as writer, \
                as_user(stack, urls[2], "api") as reader:
            store = await ResponseStore.open(writer, ttl_s=TTL_S, max_bytes=MAX_BYTES,
                                             replicas=3)
            # open() returns once the bucket's stream has a leader: before, a write right
            # after it found no responder while the new cluster elected one (seen in CI)
            js = writer.jetstream(timeout=2.0)
            info = await js.stream_info(f"KV_{subjects.RESPONSES_BUCKET}")
            assert info.cluster is not None and info.cluster.leader
            await store.put(_response_id(10), b"replicated")
            other = await ResponseStore.open(reader, ttl_s=TTL_S, max_bytes=MAX_BYTES,
                                             replicas=3)
            assert await other.get(_response_id(10)) == b"replicated"
    finally:
        stack.stop()

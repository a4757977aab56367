"""LoRA adapters' bytes in JetStream's object store (services/adapter_store_bus.py), on real
nats-servers started as `llmbus up` starts them (JetStream on, one user per service): the api
puts, lists, reads and deletes; an executor opens the bucket (also as the first to come),
reads, and puts; no other bus user reaches the bucket; names are OpenAI-style model ids."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.object_store import ObjectStore

from llmbus.bus import subjects
from llmbus.services import adapter_store_bus
from llmbus.services.adapter_store_bus import AdapterStore, AdapterStoreUnavailable
from llmbus.services.launcher import Stack
from llmbus.services.nats_auth import PERMISSIONS
from tests.bus_users import (
    ConnectAs,
    connect_as,
    nats_server,
    refusals,
    without_jetstream,
)

pytestmark = pytest.mark.adapter  # a real nats-server, no model

# 3 MB: 24 chunks of 128 KiB, enough that the server asks for flow control while it delivers
# (answered as a reply: allow_responses covers it)
BIG = bytes(range(256)) * (3 * 2**20 // 256)


# One for the tests that can share it; one of a test's own, where the bucket must not exist yet.
server = pytest.fixture(nats_server, scope="module", name="server")
fresh_server = pytest.fixture(nats_server, name="fresh_server")


@pytest.fixture
def as_user(monkeypatch) -> ConnectAs:
    return connect_as(monkeypatch)


@pytest.fixture
def impatient(monkeypatch) -> None:
    """A request the server refuses goes unanswered: give up on it quickly."""
    monkeypatch.setattr(adapter_store_bus, "REQUEST_TIMEOUT", 0.5)
    monkeypatch.setattr(adapter_store_bus, "OPEN_TIMEOUT", 0.0)
    monkeypatch.setattr(adapter_store_bus, "GET_TIMEOUT", 3.0)


async def test_the_api_puts_lists_reads_and_deletes(server, as_user):
    """As the api user, with its real permissions: many chunks read back as they were put,
    names list sorted, `has` answers from the metadata, a delete leaves nothing (and says so
    the second time)."""
    async with as_user(*server, "api") as runtime:
        store = await AdapterStore.open(runtime)
        await store.put("sql-lora", BIG)
        await store.put("ft:llmbus:org/poet@v2", b"tiny")
        await store.put("empty", b"")
        assert await store.get("sql-lora") == BIG
        assert await store.get("ft:llmbus:org/poet@v2") == b"tiny"
        assert await store.get("empty") == b""
        assert await store.names() == ["empty", "ft:llmbus:org/poet@v2", "sql-lora"]
        assert await store.has("sql-lora") and not await store.has("nothing")
        assert await store.get("nothing") is None
        assert await store.delete("sql-lora") is True
        assert await store.delete("sql-lora") is False
        assert await store.get("sql-lora") is None and not await store.has("sql-lora")
        assert await store.names() == ["empty", "ft:llmbus:org/poet@v2"]
        for name in await store.names():
            await store.delete(name)
        assert await store.names() == []


async def test_a_replaced_adapter_leaves_no_old_chunks(server, as_user):
    """Putting a name again replaces its bytes, and purges the old chunks from the stream
    (the bucket would fill with dead bytes otherwise)."""
    async with as_user(*server, "api") as runtime:
        store = await AdapterStore.open(runtime)
        js = runtime.jetstream(timeout=2)

        async def num_messages() -> int:
            return (await js.stream_info(subjects.ADAPTERS_STREAM)).state.messages

        before = await num_messages()
        await store.put("replaced", BIG)
        assert await num_messages() == before + len(BIG) // 2**17 + 1  # chunks, metadata
        await store.put("replaced", b"second")
        assert await store.get("replaced") == b"second"
        assert await num_messages() == before + 2  # its one chunk and its metadata
        await store.delete("replaced")


@pytest.mark.parametrize("name", ["a b", "a*", "a>", "", "x" * 129, "caf\u00e9", "a\nb",
                                  "a,b"])
async def test_names_that_are_no_model_id_are_refused(server, as_user, name):
    async with as_user(*server, "api") as runtime:
        store = await AdapterStore.open(runtime)
        with pytest.raises(ValueError, match="not an adapter name"):
            await store.put(name, b"x")
        assert await store.get(name) is None
        assert not await store.has(name)
        assert await store.delete(name) is False


async def test_an_executor_opens_reads_and_puts(fresh_server, as_user):
    """The executor may come first (it makes the bucket), store (or replace) the adapters it
    was given at start, and read one the api stored."""
    async with as_user(*fresh_server, "executor") as executor, \
            as_user(*fresh_server, "api") as api:
        engine_side = await AdapterStore.open(executor)
        await engine_side.put("given-at-start", BIG)
        await engine_side.put("given-at-start", b"from --lora")  # a restart, another file
        api_side = await AdapterStore.open(api)
        await api_side.put("loaded-later", BIG)
        assert await engine_side.has("loaded-later")
        assert await engine_side.get("loaded-later") == BIG
        assert await api_side.get("given-at-start") == b"from --lora"
        assert await api_side.names() == ["given-at-start", "loaded-later"]


async def test_two_copies_opening_at_once_share_one_bucket(fresh_server, as_user):
    async with as_user(*fresh_server, "api") as first, as_user(*fresh_server, "api") as second:
        one, other = await asyncio.gather(AdapterStore.open(first), AdapterStore.open(second))
        await one.put("shared", b"from one copy")
        assert await other.get("shared") == b"from one copy"


@pytest.mark.parametrize("user", [u for u in PERMISSIONS if u not in ("api", "executor")])
async def test_no_other_bus_user_reaches_the_bucket(server, user):
    """Every subject the store uses is a permissions violation for the other users (the
    server refuses the publish; the request itself goes unanswered)."""
    stream = subjects.ADAPTERS_STREAM
    used = [subjects.js_stream_api(verb, stream) for verb in (
        "STREAM.INFO", "STREAM.CREATE", "STREAM.MSG.GET", "STREAM.PURGE", "CONSUMER.CREATE")]
    used += [f"{subjects.JS_API}.STREAM.NAMES",
             subjects.object_chunks(subjects.ADAPTERS_BUCKET, "nuid"),
             subjects.object_meta(subjects.ADAPTERS_BUCKET, "bmFtZQ==")]
    errors = await refusals(*server, user, used)
    assert len(errors) == len(used), errors
    assert all("permissions violation for publish" in e for e in errors), errors


async def test_the_tokenizer_cannot_open_the_store(server, as_user, impatient):
    async with as_user(*server, "tokenizer") as runtime:
        with pytest.raises(AdapterStoreUnavailable, match="may this bus user use the bucket"):
            await AdapterStore.open(runtime)


async def test_the_tokenizer_cannot_read_a_bound_store(server, as_user, impatient):
    """Even handed the api's bucket (its nats-py object bound over the tokenizer's
    connection), the tokenizer reads nothing: each request is refused."""
    async with as_user(*server, "api") as api, as_user(*server, "tokenizer") as tokenizer:
        await (await AdapterStore.open(api)).put("secret", b"weights")
        js = tokenizer.jetstream(timeout=0.5)
        store = AdapterStore(ObjectStore(subjects.ADAPTERS_BUCKET, subjects.ADAPTERS_STREAM, js))
        for call in (store.get("secret"), store.has("secret"), store.names()):
            with pytest.raises(AdapterStoreUnavailable, match="could not"):
                await call


async def test_a_server_without_jetstream_makes_the_store_unavailable(monkeypatch):
    async with without_jetstream(monkeypatch) as runtime:
        with pytest.raises(AdapterStoreUnavailable, match="no JetStream.*LoRA adapters"):
            await AdapterStore.open(runtime)


async def test_a_cluster_keeps_the_bucket_on_every_server(as_user):
    """The launcher's three servers form one JetStream cluster: a bucket of 3 replicas,
    written through one server, reads back through another."""
    stack = Stack()
    urls = stack.start_nats_cluster(3)
    try:
        async with as_user(stack, urls[0], "api") as writer, \
                as_user(stack, urls[2], "executor") as reader:
            await (await AdapterStore.open(writer, replicas=3)).put("replicated", BIG)
            other = await AdapterStore.open(reader, replicas=3)
            assert await other.get("replicated") == BIG
            info = await reader.jetstream(timeout=2).stream_info(subjects.ADAPTERS_STREAM)
            assert info.config.num_replicas == 3
    finally:
        stack.stop()

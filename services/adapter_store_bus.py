"""LoRA adapters' bytes in NATS JetStream's object store, where every engine on any host finds
them (issue 44: engines on other hosts get an adapter over the bus, not as a path that exists
only where the api runs).

The bucket `llmbus_adapters` is a JetStream stream on the servers' disks (on `replicas`
servers of a cluster): each adapter is one object, named as clients name it in `model`, its
bytes cut in 128 KiB chunks (`$O.<bucket>.C.<nuid>`) under one metadata message
(`$O.<bucket>.M.<name, base64>`). An adapter is what `pack_adapter` made of a PEFT folder or a
GGUF adapter: this module only keeps bytes, and never looks inside them.

Who uses it: the api puts an adapter (`POST /v1/load_lora_adapter`), lists the names
(`/v1/models`), asks whether one exists (resolving a request's `model`) and deletes one
(`/v1/unload_lora_adapter`); an executor gets an adapter's bytes when told to load it, and puts
those it was given at start. Every failure of the store reaches the caller as one exception,
AdapterStoreUnavailable, with a message an operator can act on.
"""

from __future__ import annotations

import asyncio
import io
import re

import nats.errors
import structlog
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.object_store import ObjectStore

from llmbus.bus import subjects
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.jetstream_bus import STREAM_NAME_IN_USE, errors_as, open_bucket

INSUFFICIENT_RESOURCES = 10047  # JetStream's error: its storage limit would be passed

log = structlog.get_logger()

REQUEST_TIMEOUT = 5.0  # seconds one JetStream request (or one chunk's ack) waits
# Seconds open() keeps asking while JetStream does not answer: a new cluster's servers take a
# few to elect the leader that creates streams (tests shorten it).
OPEN_TIMEOUT = 30.0
# Seconds a whole `get` may take: nats-py's reading has no deadline of its own, and a server
# lost mid-transfer would hold it forever. Generous: a rank-64 adapter of a 7B model is ~300 MB.
GET_TIMEOUT = 300.0
DEFAULT_MAX_BYTES = 4 * 2**30  # the bucket's room; past it, putting is refused
# What OpenAI model ids look like (`ft:gpt-4o:org:name:id`, `org/model@v2`): names reach
# subjects only base64-encoded, so `.`, `/` and `:` are safe; no spaces, no wildcards.
_VALID_NAME = re.compile(r"[-_.:/@A-Za-z0-9]{1,128}")


class AdapterStoreUnavailable(RuntimeError):
    """The store cannot be used (JetStream is off, does not answer, refuses this bus user, or
    the bucket is full); the message says why and what to do."""


def check_name(name: str) -> str:
    """`name` if an adapter may be called so; ValueError naming the rule otherwise."""
    if not _VALID_NAME.fullmatch(name):
        raise ValueError(f"not an adapter name: {name!r} (1 to 128 letters, digits and "
                         "`-_.:/@`)")
    return name


class AdapterStore:
    """Adapters' bytes by name, in the bus's JetStream bucket `llmbus_adapters`; made by
    `open`. Shared by every api copy and executor on the same NATS servers (or cluster)."""

    def __init__(self, objects: ObjectStore) -> None:
        self._objects = objects

    @classmethod
    async def open(cls, runtime: ServiceRuntime, replicas: int = 1, *,
                   max_bytes: int = DEFAULT_MAX_BYTES) -> AdapterStore:
        """Bind to the bucket, creating it (file storage, these limits) if it does not exist;
        copies opening it at once all succeed. A bucket made with other limits is kept as it
        is, with a warning. Raises AdapterStoreUnavailable if JetStream is off, refuses this
        bus user, or does not answer in time."""
        config = api.ObjectStoreConfig(
            bucket=subjects.ADAPTERS_BUCKET, storage=api.StorageType.FILE, replicas=replicas,
            max_bytes=max_bytes, description="llmbus: LoRA adapters")
        objects = await open_bucket(
            runtime, lambda js: _create_or_bind(js, config), stream=f"OBJ_{config.bucket}",
            store="the adapter store", holds="LoRA adapters", unavailable=AdapterStoreUnavailable,
            request_timeout=REQUEST_TIMEOUT, open_timeout=OPEN_TIMEOUT)
        return cls(objects)

    async def put(self, name: str, blob: bytes) -> None:
        """Store `blob` as the adapter `name`, replacing one of that name. ValueError for a
        name the rule refuses."""
        check_name(name)
        with errors_as(AdapterStoreUnavailable, f"store the adapter {name!r}"):
            await self._objects.put(name, blob)

    async def get(self, name: str) -> bytes | None:
        """The adapter's bytes (checked against the digest stored with them); None if there
        is none of that name (never stored, deleted, or not a valid name)."""
        if not _VALID_NAME.fullmatch(name):
            return None
        into = io.BytesIO()  # nats-py's default appends bytes to bytes: quadratic in chunks
        with errors_as(AdapterStoreUnavailable, f"read the adapter {name!r}"):
            try:
                await asyncio.wait_for(self._objects.get(name, writeinto=into), GET_TIMEOUT)
            except NotFoundError:  # also deleted ones
                return None
            except nats.errors.TimeoutError:
                raise  # one request unanswered: errors_as says so
            except TimeoutError:
                raise AdapterStoreUnavailable(
                    f"could not read the adapter {name!r}: its bytes did not all arrive within "
                    f"{GET_TIMEOUT:g} s") from None
        return into.getvalue()

    async def has(self, name: str) -> bool:
        """Whether an adapter `name` is stored: one request for its metadata, no bytes."""
        if not _VALID_NAME.fullmatch(name):
            return False
        with errors_as(AdapterStoreUnavailable, f"look up the adapter {name!r}"):
            try:
                await self._objects.get_info(name)
            except NotFoundError:
                return False
        return True

    async def delete(self, name: str) -> bool:
        """Delete the adapter `name` (its bytes go at once); False if there was none. Another
        copy deleting the same name at once may also see True."""
        if not _VALID_NAME.fullmatch(name):
            return False
        with errors_as(AdapterStoreUnavailable, f"delete the adapter {name!r}"):
            try:
                await self._objects.delete(name)
            except NotFoundError:
                return False
        return True

    async def names(self) -> list[str]:
        """Every stored adapter's name, sorted."""
        with errors_as(AdapterStoreUnavailable, "list the adapters"):
            try:
                infos = await self._objects.list(ignore_deletes=True)
            except NotFoundError:  # nats-py's way of saying: none
                return []
        return sorted(info.name for info in infos if info.name)


async def _create_or_bind(js: JetStreamContext, config: api.ObjectStoreConfig) -> ObjectStore:
    """The bucket as it is where it exists (kept, with one warning line where its limits are
    not `config`'s), else made with `config`. Binding comes first: copies that start at once
    (every api copy and executor) would otherwise race to create it, and JetStream refuses the
    losers (the name in use, or its storage counted as reserved once per request)."""
    try:
        objects = await js.object_store(subjects.ADAPTERS_BUCKET)
    except BucketNotFoundError:
        try:
            return await js.create_object_store(subjects.ADAPTERS_BUCKET, config=config)
        except APIError as exc:  # made meanwhile by another copy, or refused for good
            if exc.err_code not in (STREAM_NAME_IN_USE, INSUFFICIENT_RESOURCES):
                raise
            objects = await js.object_store(subjects.ADAPTERS_BUCKET)
    found = (await objects.status()).stream_info.config
    if (found.max_bytes, found.num_replicas) != (config.max_bytes, config.replicas):
        log.warning("the adapter store's bucket exists with other limits; keeping them",
                    bucket=config.bucket, max_bytes=found.max_bytes,
                    wanted_max_bytes=config.max_bytes, replicas=found.num_replicas,
                    wanted_replicas=config.replicas)
    return objects

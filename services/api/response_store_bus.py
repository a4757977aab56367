"""Stored responses (the Responses API's `store: true` and `previous_response_id`) in NATS
JetStream's key-value store.

Why on the bus and not in the api's memory: every api copy, on any host, must find what any
other copy stored, and a copy's restart must lose nothing. The bucket `llmbus_responses` is a
JetStream stream on the servers' disks (on `replicas` servers of a cluster), holding one value
per response id (history 1), each removed by the server `ttl_s` after it was written (OpenAI
keeps stored responses 30 days). A bucket holding `max_bytes` refuses new values; it never
drops old ones to make room.

The api's pure code (services/api/responses_api.py) gets a ResponseStore, or None where
`open` raised ResponseStoreUnavailable; every failure of the store reaches it as that one
exception, with a message an operator can act on, so that it needs nothing of nats-py.
"""

from __future__ import annotations

import re

import structlog
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, KeyNotFoundError
from nats.js.kv import KeyValue

from llmbus.bus import subjects
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.jetstream_bus import STREAM_NAME_IN_USE, errors_as, open_bucket

log = structlog.get_logger()

REQUEST_TIMEOUT = 2.0  # seconds one JetStream request waits for the server's answer
# Seconds open() keeps asking while JetStream does not answer: a new cluster's servers take a
# few to elect the leader that creates streams (tests shorten it).
OPEN_TIMEOUT = 30.0
# A response id becomes the last token of a subject: letters, digits and `-_/=` (what a KV key
# may hold) but no `.` (a subject's separator), `*` or `>` (wildcards); and short, since the
# server drops a connection whose protocol line is too long.
_VALID_ID = re.compile(r"[-_/=A-Za-z0-9]{1,200}")


class ResponseStoreUnavailable(RuntimeError):
    """The store cannot be used (JetStream is off, does not answer, refuses this bus user, or
    the bucket is full); the message says why and what to do."""


class ResponseStore:
    """Stored responses by id, in the bus's JetStream bucket `llmbus_responses`; made by
    `open`. Shared by every api copy on the same NATS servers (or cluster)."""

    def __init__(self, runtime: ServiceRuntime, kv: KeyValue) -> None:
        self._runtime = runtime
        self._kv = kv

    @classmethod
    async def open(cls, runtime: ServiceRuntime, *, ttl_s: float, max_bytes: int,
                   replicas: int = 1) -> ResponseStore:
        """Bind to the bucket, creating it (file storage, history 1, these limits) if it does
        not exist; copies opening it at once all succeed. A bucket made with other limits is
        kept as it is, with a warning (changing it under running copies would surprise them).
        Raises ResponseStoreUnavailable if JetStream is off or does not answer in time."""
        config = api.KeyValueConfig(
            bucket=subjects.RESPONSES_BUCKET, ttl=ttl_s, max_bytes=max_bytes, history=1,
            storage=api.StorageType.FILE, replicas=replicas, direct=True)
        kv = await open_bucket(
            runtime, lambda js: _create_or_bind(js, config), stream=f"KV_{config.bucket}",
            store="the response store", holds="stored responses",
            unavailable=ResponseStoreUnavailable, request_timeout=REQUEST_TIMEOUT,
            open_timeout=OPEN_TIMEOUT)
        return cls(runtime, kv)

    async def put(self, response_id: str, value: bytes) -> None:
        """Store `value` under `response_id` (replacing what was there), for the bucket's TTL.
        ValueError for an id a key cannot hold or a value over the server's max_payload."""
        if not _VALID_ID.fullmatch(response_id):
            raise ValueError(f"not a response id a store key can hold: {response_id!r}")
        assert self._runtime.nc is not None
        limit = self._runtime.nc.max_payload
        if len(value) > limit:
            raise ValueError(f"a stored response of {len(value)} bytes is over the bus's "
                             f"limit of {limit} bytes (the NATS server's max_payload)")
        with errors_as(ResponseStoreUnavailable, "store the response"):
            await self._kv.put(response_id, value)

    async def get(self, response_id: str) -> bytes | None:
        """The value stored under `response_id`; None if there is none (never stored,
        deleted, expired) or the id is not one a key can hold."""
        if not _VALID_ID.fullmatch(response_id):
            return None
        with errors_as(ResponseStoreUnavailable, "read the response"):
            try:
                entry = await self._kv.get(response_id)
            except KeyNotFoundError:  # also deleted ones (their marker)
                return None
        return entry.value or b""

    async def delete(self, response_id: str) -> bool:
        """Delete the value under `response_id`; False if there was none (or the id is not
        one a key can hold). Another copy deleting the same id at once may also see True."""
        if await self.get(response_id) is None:
            return False
        with errors_as(ResponseStoreUnavailable, "delete the response"):
            await self._kv.delete(response_id)
        return True


async def _create_or_bind(js: JetStreamContext, config: api.KeyValueConfig) -> KeyValue:
    """The bucket, made with `config` (a no-op where it exists with the same one), or as it is
    where it exists with another, with one warning line naming both."""
    try:
        return await js.create_key_value(config)
    except BadRequestError as exc:
        if exc.err_code != STREAM_NAME_IN_USE:
            raise
    kv = await js.key_value(config.bucket)
    found = (await kv.status()).stream_info.config
    if (found.max_age, found.max_bytes, found.num_replicas) != (
            config.ttl, config.max_bytes, config.replicas):
        log.warning("the response store's bucket exists with other limits; keeping them",
                    bucket=config.bucket, ttl_s=found.max_age, wanted_ttl_s=config.ttl,
                    max_bytes=found.max_bytes, wanted_max_bytes=config.max_bytes,
                    replicas=found.num_replicas, wanted_replicas=config.replicas)
    return kv


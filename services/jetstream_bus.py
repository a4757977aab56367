"""What the bus's JetStream stores share (the api's stored responses,
services/api/response_store_bus.py; the LoRA adapters, services/adapter_store_bus.py): opening a
bucket while a new cluster may still be electing the leader that creates streams, and nats-py's
errors turned into the store's one exception, with a message an operator can act on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, ServiceUnavailableError

from llmbus.bus.runtime import ServiceRuntime

T = TypeVar("T")
STREAM_NAME_IN_USE = 10058  # JetStream's error: the stream exists with another configuration


async def open_bucket(runtime: ServiceRuntime, create: Callable[[JetStreamContext], Awaitable[T]],
                      *, stream: str, store: str, holds: str, unavailable: type[Exception],
                      request_timeout: float, open_timeout: float) -> T:
    """`create(js)` (which makes or binds the bucket), asked again every 0.25 s while
    JetStream does not answer, then the bucket's `stream` asked until it has a leader (on a
    new cluster a replicated stream elects one after it is made, and until then a write finds
    no responder), for up to `open_timeout` seconds in all. Raises `unavailable` (with
    `store`, "the response store", and what it `holds`, "stored responses", in its message)
    when this server runs no JetStream, JetStream refuses the bucket, or time runs out."""
    js = runtime.jetstream(timeout=request_timeout)
    deadline = time.monotonic() + open_timeout
    bucket: T | None = None
    while True:
        try:
            if bucket is None:
                bucket = await create(js)
            cluster = (await js.stream_info(stream)).cluster
            if cluster is None or cluster.leader:
                return bucket
            error: Exception = RuntimeError(f"{stream} has no leader yet")
        except ServiceUnavailableError as exc:
            if exc.err_code is None and bucket is None:  # no responders: no JetStream here
                raise unavailable(
                    f"the NATS server has no JetStream, where {holds} live: enable it (a "
                    "`jetstream` block in its configuration; `llmbus up` and the compose "
                    "files do)") from exc
            error = exc  # JetStream not ready yet (a cluster's leader)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            error = exc
        except APIError as exc:
            if bucket is None:
                raise unavailable(
                    f"JetStream refused {store}'s bucket: {exc.description}") from exc
            error = exc  # the stream, made, not yet answering
        if time.monotonic() > deadline:
            raise unavailable(
                f"JetStream did not answer within {open_timeout:g} s ({error}): is the "
                "cluster up, and may this bus user use the bucket (services/nats_auth.py)?")
        await asyncio.sleep(0.25)


@contextmanager
def errors_as(unavailable: type[Exception], doing: str) -> Iterator[None]:
    """nats-py's errors (no answer, a refusal, a full bucket) as `unavailable`."""
    try:
        yield
    except APIError as exc:
        raise unavailable(f"could not {doing}: JetStream answered {exc.description!r}") from exc
    except nats.errors.Error as exc:
        raise unavailable(f"could not {doing}: {exc}") from exc

"""What the tests of the bus's JetStream stores share (tests/api/test_response_store.py,
tests/api/test_adapter_store.py): a nats-server as `llmbus up` starts it (JetStream on, one
user per service), a service's runtime connected as one of those users, and the server's
refusals of a user's publishes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import nats
import pytest

from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.launcher import Stack


def nats_server() -> Iterator[tuple[Stack, str]]:
    """A fixture's body: a nats-server with JetStream and the services' users; yields the
    stack (its `passwords`) and the server's URL."""
    stack = Stack()
    url = stack.start_nats()
    yield stack, url
    stack.stop()


ConnectAs = Callable[[Stack, str, str], AbstractAsyncContextManager[ServiceRuntime]]


def connect_as(monkeypatch: pytest.MonkeyPatch) -> ConnectAs:
    """`async with connect(stack, url, "api") as runtime`: a ServiceRuntime of that user."""

    @asynccontextmanager
    async def connect(stack: Stack, url: str, user: str) -> AsyncIterator[ServiceRuntime]:
        monkeypatch.setenv("LLMBUS_NATS_USER", user)
        monkeypatch.setenv("LLMBUS_NATS_PASSWORD", stack.passwords[user])
        async with ServiceRuntime(user, url, handle_signals=False) as runtime:
            yield runtime

    return connect


@asynccontextmanager
async def without_jetstream(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ServiceRuntime]:
    """An api runtime on a nats-server of its own that runs no JetStream (and no users)."""
    monkeypatch.delenv("LLMBUS_NATS_USER", raising=False)
    stack = Stack()
    url = stack.start_nats(auth=False, jetstream=False)
    try:
        async with ServiceRuntime("api", url, handle_signals=False) as runtime:
            yield runtime
    finally:
        stack.stop()


async def refusals(stack: Stack, url: str, user: str, subjects: list[str]) -> list[str]:
    """Publish to each subject (with a reply inbox, as a request does) as `user`; the errors
    the server sent back, once there is one per subject (or after 15 s)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    client = await nats.connect(url, user=user, password=stack.passwords[user],
                                error_cb=on_error)
    try:
        for subject in subjects:
            await client.publish(subject, b"{}", reply="_INBOX.x")
        await client.flush()
        async with asyncio.timeout(15):
            while len(errors) < len(subjects):
                await asyncio.sleep(0.05)
    except TimeoutError:
        pass  # the caller's assertion shows what came
    finally:
        await client.close()
    return errors

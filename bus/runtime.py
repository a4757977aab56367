# Over 300 lines: the one connection every service has, with what it must do for the others
# (handlers, heartbeats, its own bus health, reconnects, drain).
"""The service runtime: one NATS connection, typed handlers, readiness, graceful drain.

Every service has the same skeleton:

    async with ServiceRuntime("tokenizer", url, instance_id) as runtime:  # connect, signals
        ...register handlers...
        await runtime.serve()  # ready, heartbeats, until SIGTERM/SIGINT
    # leaving the block drains the subscriptions (in-flight handlers finish) and closes

A service that waits on something else (the api's HTTP server) calls `mark_ready()` instead of
`serve()`. nats-py calls one subscription's handler for one message at a time; a handler that
waits on another service (admission) takes `concurrency=N` so that one slow answer does not
hold the messages behind it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import context as otel_context

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.liveness import HEARTBEAT_INTERVAL
from llmbus.bus.messages import Heartbeat, Ping, Pong
from llmbus.bus.servers import (
    MAX_OUTSTANDING_PINGS,
    PING_INTERVAL,
    StuckClose,
    connect_order,
    server_urls,
    tls_options,
)
from llmbus.bus.tracing import extract_context, inject_headers

T = TypeVar("T", bound=msgspec.Struct)
R = TypeVar("R", bound=msgspec.Struct)

log = structlog.get_logger()

DRAIN_TIMEOUT = 5.0  # seconds close() gives in-flight handlers before it cancels them


def new_instance_id() -> str:
    return uuid.uuid4().hex[:8]


class ServiceRuntime:
    """Owns the NATS connection of one service instance."""

    def __init__(self, service: str, nats_url: str, instance_id: str | None = None, *,
                 handle_signals: bool = True) -> None:
        """`handle_signals=False` where something else (uvicorn) takes SIGTERM/SIGINT."""
        self.service = service
        self.handle_signals = handle_signals
        self.nats_url = nats_url
        self.instance_id = instance_id or new_instance_id()
        self.nc: Client | None = None
        self.ready = False
        self.stop_event = asyncio.Event()
        self._subscriptions: list[Any] = []
        self._handler_tasks: set[asyncio.Task] = set()  # handlers of concurrency > 1
        self._cancelling = False  # close() gave up waiting for them
        self.drain_timeout = DRAIN_TIMEOUT
        self._heartbeat_task: asyncio.Task | None = None
        self._make_heartbeat: Callable[[], Heartbeat] | None = None
        self.num_handled = 0  # the service counts its work here; heartbeats report it
        self.num_reconnects = 0  # heartbeats report it: see Heartbeat.num_reconnects
        self.incarnation = secrets.token_hex(4)  # Heartbeat.incarnation
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        # When a round trip to the server last succeeded (monotonic): the clock by which this
        # copy judges the others' silence (see bus_time).
        self.bus_alive_at = 0.0
        self._probe_task: asyncio.Task | None = None
        self._stuck_close = StuckClose()  # a lost connection whose close hangs is dropped

    async def __aenter__(self) -> ServiceRuntime:
        await self.connect()
        if self.handle_signals:
            self.install_signal_handlers()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def mark_ready(self, heartbeat: Callable[[], Heartbeat] | None = None) -> None:
        """Ready: answer pings as ready, and start the heartbeats (`heartbeat` makes each)."""
        self.ready = True
        self.start_heartbeat(heartbeat)
        log.info(f"{self.service} ready")

    async def serve(self, heartbeat: Callable[[], Heartbeat] | None = None) -> None:
        """Mark ready, then wait for SIGTERM/SIGINT."""
        self.mark_ready(heartbeat)
        await self.stop_event.wait()

    async def connect(self) -> None:
        async def on_error(exc: Exception) -> None:
            log.warning("nats error", error=str(exc))

        # Credentials come from the environment (the command line shows in `ps`).
        credentials = {}
        if os.environ.get("LLMBUS_NATS_USER"):
            user = os.environ["LLMBUS_NATS_USER"]
            # replies on inboxes only this user may read (services/nats_auth.py)
            credentials = {"user": user, "password": os.environ.get("LLMBUS_NATS_PASSWORD", ""),
                           "inbox_prefix": subjects.inbox_prefix(user)}
        self.nc = await nats.connect(
            connect_order(server_urls(self.nats_url)),
            name=f"llmbus-{self.service}-{self.instance_id}",
            error_cb=on_error, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            ping_interval=PING_INTERVAL, max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            dont_randomize=True,  # connect_order's: the user's first, then spread
            disconnected_cb=self._disconnected, reconnected_cb=self._reconnected,
            **credentials, **tls_options(self.nats_url))
        await self.on_request(subjects.ping(self.service), Ping, self._pong)
        self.bus_alive_at = time.monotonic()
        self._probe_task = asyncio.create_task(self._probe())

    def jetstream(self, timeout: float) -> JetStreamContext:
        """nats-py's JetStream context on this connection (the api's stored responses,
        services/api/response_store_bus.py): its requests wait up to `timeout` for the server
        and take their replies on this copy's own inbox, as its other requests do."""
        assert self.nc is not None
        return self.nc.jetstream(timeout=timeout)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def bus_time(self) -> float:
        """The time to judge other copies' silence by: the last successful round trip to the
        server (at most a probe, HEARTBEAT_INTERVAL, behind now while the bus works). A
        connection that hangs (its server paused or cut off, no RST) takes seconds to be
        noticed, and the others were silent only to us meanwhile: they must not be reaped
        for it."""
        return self.bus_alive_at

    async def _probe(self) -> None:
        while not self.stop_event.is_set():
            if self.connected:
                try:
                    assert self.nc is not None
                    await self.nc.flush(timeout=1)  # one PING/PONG: seconds, as an int
                    self.bus_alive_at = time.monotonic()
                except (nats.errors.Error, TimeoutError):
                    pass  # timed out or dropped: the clock stays where it was
            elif self.nc is not None and self._stuck_close.check(self.nc, time.monotonic()):
                log.warning("bus connection dropped: its close hung", service=self.service)
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Call `callback()` each time the connection is back after a loss: what was sent to
        or by this copy meanwhile may be lost (core NATS is at-most-once), and the service
        decides what to recover. The subscriptions themselves are restored by nats-py."""
        self._on_reconnect.append(callback)

    async def _disconnected(self) -> None:
        if self.ready:  # not while closing
            log.warning("bus connection lost; reconnecting", service=self.service)
    async def _reconnected(self) -> None:
        self.num_reconnects += 1
        url = self.nc.connected_url if self.nc is not None else None
        log.warning("bus connection back", service=self.service, server=url and url.netloc)
        await self._beat_now()  # announce ourselves before any watcher gives up on us
        for callback in self._on_reconnect:
            try:
                await callback()
            except Exception:
                log.exception("reconnect handler failed")

    async def _pong(self, _: Ping, __: Msg) -> Pong:
        return Pong(service=self.service, instance_id=self.instance_id, ready=self.ready)

    async def on_message(self, subject: str, message_type: type[T],
                         handler: Callable[[T, Msg], Awaitable[None]],
                         queue: str = "", concurrency: int = 1) -> None:
        """Call `handler(decoded, raw)` for each message; the trace context is made current.
        Returns once the server has the subscription, so that what other connections send
        from then on reaches it.

        `concurrency=1` handles one message after the other (for subscriptions whose order
        matters). More runs each handler as a task of its own, at most `concurrency` at once:
        when all are busy the next message waits in the subscription's queue (back-pressure).
        """

        async def handle(msg: Msg) -> None:
            token = otel_context.attach(extract_context(msg.headers))
            try:
                await handler(decode(msg.data, message_type), msg)
            except Exception:
                log.exception("handler failed", subject=msg.subject)
            finally:
                otel_context.detach(token)

        callback = handle if concurrency == 1 else self._in_tasks(handle, concurrency)
        assert self.nc is not None
        self._subscriptions.append(await self.nc.subscribe(subject, queue=queue, cb=callback))
        await self.nc.flush()

    def _in_tasks(self, handle: Callable[[Msg], Coroutine[Any, Any, None]],
                  concurrency: int) -> Callable[[Msg], Awaitable[None]]:
        """A callback that starts `handle(msg)` as a task once one of `concurrency` slots is
        free; close() waits for the tasks (or cancels them)."""
        slots = asyncio.Semaphore(concurrency)

        def done(task: asyncio.Task) -> None:
            self._handler_tasks.discard(task)
            slots.release()

        async def callback(msg: Msg) -> None:
            await slots.acquire()
            if self._cancelling:  # dropped, as a closed connection would
                slots.release()
                return
            task = asyncio.create_task(handle(msg))  # a copy of the context: its own trace
            self._handler_tasks.add(task)
            task.add_done_callback(done)

        return callback

    async def on_request(self, subject: str, message_type: type[T],
                         handler: Callable[[T, Msg], Awaitable[msgspec.Struct]],
                         queue: str = "", concurrency: int = 1) -> None:
        """Like on_message, but the handler's return value is sent back as the reply."""

        async def reply(request: T, msg: Msg) -> None:
            response = await handler(request, msg)
            await msg.respond(encode(response))

        await self.on_message(subject, message_type, reply, queue=queue,
                              concurrency=concurrency)

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        assert self.nc is not None
        await self.nc.publish(subject, encode(message), headers=inject_headers())

    def thread_publisher(self, subject: str) -> Callable[[msgspec.Struct], None]:
        """A publish for another thread (an executor's forward thread) that does not wait:
        the message goes out from the event loop this is called on, in the order given."""
        loop = asyncio.get_running_loop()

        def publish(message: msgspec.Struct) -> None:
            asyncio.run_coroutine_threadsafe(self.publish(subject, message), loop)
        return publish

    async def request(self, subject: str, message: msgspec.Struct, reply_type: type[R],
                      timeout: float) -> R:
        """Request/reply; raises nats.errors.NoRespondersError / TimeoutError."""
        assert self.nc is not None
        msg = await self.nc.request(subject, encode(message), timeout=timeout,
                                    headers=inject_headers())
        return decode(msg.data, reply_type)

    async def gather(self, subject: str, message: msgspec.Struct, reply_type: type[R], *,
                     expected: int, timeout: float,
                     done: Callable[[list[R]], bool] | None = None) -> list[R]:
        """Scatter-gather: every subscriber of `subject` answers; returns once `expected`
        replies are in (and, given `done`, `done(replies)` says they are the ones awaited),
        or after `timeout` with those that came."""
        assert self.nc is not None
        inbox = self.nc.new_inbox()
        replies: list[R] = []
        enough = asyncio.Event()

        async def collect(msg: Msg) -> None:
            if not msg.data:  # the server's "no responders" status: nobody serves `subject`
                return
            replies.append(decode(msg.data, reply_type))
            if len(replies) >= expected and (done is None or done(replies)):
                enough.set()

        subscription = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(subject, encode(message), reply=inbox)
            try:
                await asyncio.wait_for(enough.wait(), timeout)
            except TimeoutError:
                pass
        finally:
            await subscription.unsubscribe()
        return replies

    def start_heartbeat(self, make: Callable[[], Heartbeat] | None = None) -> None:
        """Publish a heartbeat every HEARTBEAT_INTERVAL while the service is ready."""
        self._make_heartbeat = make or (lambda: Heartbeat(
            service=self.service, instance_id=self.instance_id, num_handled=self.num_handled))

        async def beat() -> None:
            while not self.stop_event.is_set():
                await self._beat_now()
                await asyncio.sleep(HEARTBEAT_INTERVAL)

        self._heartbeat_task = asyncio.create_task(beat())

    async def _beat_now(self) -> None:
        """One heartbeat, if ready and connected (nothing is queued while disconnected, so a
        copy that comes back is not announced by a burst of stale beats)."""
        if not (self.ready and self._make_heartbeat is not None and self.connected):
            return
        heartbeat = self._make_heartbeat()
        heartbeat.num_reconnects = self.num_reconnects
        heartbeat.incarnation = self.incarnation
        assert self.nc is not None
        try:
            await self.nc.publish(subjects.heartbeat(self.service), encode(heartbeat))
        except Exception as exc:  # a hiccup of the bus must not end the beat
            log.warning("heartbeat failed", error=str(exc))

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)

    async def close(self) -> None:
        """Stop taking messages, let in-flight handlers finish (their requests and replies
        still travel) for up to `drain_timeout`, cancel the rest, then drain and close."""
        self.ready = False
        for task in (self._heartbeat_task, self._probe_task):
            if task is not None:
                task.cancel()
        if self.nc is None or self.nc.is_closed:
            return
        if self.nc.is_connected:  # else no reply could leave: nothing to wait for
            try:
                await asyncio.wait_for(self._drain_handlers(), timeout=self.drain_timeout)
            except TimeoutError:  # handlers too slow: what is left is cancelled
                pass
        self._cancelling = True
        for task in self._handler_tasks:
            task.cancel()
        await asyncio.gather(*self._handler_tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=self.drain_timeout)
        except Exception:  # a dead server must not turn shutdown into a hang
            await self.nc.close()

    async def _drain_handlers(self) -> None:
        # The subscriptions first (inline handlers finish), so that no task starts after.
        await asyncio.gather(*(subscription.drain() for subscription in self._subscriptions),
                             return_exceptions=True)
        while self._handler_tasks:
            await asyncio.wait(set(self._handler_tasks))

"""A client that leaves before its answer began ends the work done for it.

A streamed answer notices a closed connection itself (litestar's streaming response listens
for `http.disconnect` and closes the generator, whose `finally` aborts the requests). A
non-streamed one sends nothing until the end, so nothing would notice: its handler would go on
computing for a client that is gone (an SDK's time-out and retry leaves such a ghost each
time). This middleware watches the connection of every POST once its body has been read and,
if the client leaves before the response has started, cancels the handler: the cancellation
reaches the awaits in `Generation.collect` and `embed`, whose `finally` aborts the requests in
every stage (their KV blocks are freed) and a Responses answer is never stored.
"""

from __future__ import annotations

import asyncio
import contextlib

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send


def abort_on_disconnect(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP or scope.get("method") != "POST":
            await app(scope, receive, send)
            return
        body_read = asyncio.Event()
        response_started = False

        async def receiving() -> ReceiveMessage:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def sending(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        async def client_left() -> None:
            await body_read.wait()  # before that, the handler's own reads see a disconnect
            while (await receive())["type"] != "http.disconnect":
                pass

        handler = asyncio.ensure_future(app(scope, receiving, sending))
        watcher = asyncio.ensure_future(client_left())
        try:
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not handler.done() and not response_started:
                handler.cancel()  # gone before any answer: nothing is sent, nothing kept
                with contextlib.suppress(asyncio.CancelledError):
                    await handler
                return
            await handler  # answering (a stream notices a disconnect itself) or answered
        finally:
            watcher.cancel()
            if not handler.done():  # this request itself was cancelled (server shutdown)
                handler.cancel()

    return middleware

"""WebSocket mode of the Responses API (`wss://.../v1/responses`): one connection, many turns.

The client sends `{"type": "response.create", ...}` with the same fields as `POST
/v1/responses` (`stream` is implied, `background` is not offered); the server answers each with
the events a streamed response has, as JSON text messages, one turn at a time in the order
they came. A bad turn is one `error` event and the connection stays open for the next; a
client that closes the socket mid-turn aborts that turn's work, as a closed HTTP stream does.
"""

from __future__ import annotations

from contextlib import aclosing

import msgspec
import structlog
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect

from llmbus.services.api.bodies import convert
from llmbus.services.api.errors import OpenAIError, bad_request, error_body
from llmbus.services.api.responses_api import begin, events
from llmbus.services.api.responses_schema import ResponsesRequest

log = structlog.get_logger()
_TRANSPORT_FIELDS = ("stream", "background")  # HTTP's: meaningless or refused on a socket


def _request(raw: str | bytes) -> ResponsesRequest:
    """A client event as the create request it carries; a 400 (as an `error` event) if it is
    not a `response.create` this server takes."""
    try:
        event = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"the message is not valid JSON: {exc}") from None
    if not isinstance(event, dict) or event.get("type") != "response.create":
        kind = event.get("type") if isinstance(event, dict) else None
        raise bad_request(f"client events of type {kind!r} are not supported; send "
                          "`response.create`", param="type")
    body = {key: value for key, value in event.items() if key != "type"}
    for name in _TRANSPORT_FIELDS:
        if body.get(name) is not None:
            raise bad_request(f"`{name}` is not sent over a WebSocket: every response streams "
                              "here, none runs in the background", param=name)
    return convert(body, ResponsesRequest)


@websocket("/responses")
async def responses_socket(socket: WebSocket) -> None:
    await socket.accept()
    state = socket.app.state
    try:
        while True:
            raw = await socket.receive_data(mode="text")
            try:
                turn = await begin(state, _request(raw))
            except OpenAIError as exc:
                await socket.send_text(msgspec.json.encode(_error(exc)).decode())
                continue
            async with aclosing(events(state, turn)) as stream:
                async for _, body in stream:
                    await socket.send_text(msgspec.json.encode(body).decode())
    except (WebSocketDisconnect, OSError):  # closed by the client (uvicorn's is an OSError)
        log.info("responses socket closed by its client")


def _error(exc: OpenAIError) -> dict:
    """An `error` event as a streamed response's (code, message, param) with the HTTP
    status and error body it would have had."""
    body = error_body(exc.status_code, exc.message, exc.param, exc.code)
    return {"type": "error", "sequence_number": 0, "status": exc.status_code,
            "code": exc.code or body["error"]["type"], "message": exc.message,
            "param": exc.param, **body}

"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): a
translation onto the chat path (services/api/chat.py), never a second pipeline.

A Messages request becomes a `ChatCompletionRequest` (anthropic_requests.py), is admitted by
`start_chat`, and its chat chunks become Anthropic's events (anthropic_events.py); a
non-streamed answer is those same events folded into one message, so both modes share one
translation and the thinking budget (which ends a generation mid-way) holds in both. Errors on
these routes, litestar's own included, are in Anthropic's shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing

from litestar import Request, Response, Router, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException

from llmbus.services.api.anthropic_events import Event, MessageStream, message_of
from llmbus.services.api.anthropic_requests import MessagesRequest, chat_request, thinking_budget
from llmbus.services.api.bodies import decode_body
from llmbus.services.api.chat import count_chat_tokens, start_chat
from llmbus.services.api.errors import OpenAIError, log
from llmbus.services.api.generation import Generation
from llmbus.services.api.openapi import body_of
from llmbus.services.api.sse import sse_response


async def _events(generation: Generation,
                  stream: MessageStream) -> AsyncGenerator[Event, None]:
    """The message's events as its chat chunks come; leaving early (the thinking budget, a
    client gone) closes the chunks, which aborts the request in the pipeline."""
    for event in stream.start():
        yield event
    async with aclosing(generation.chunks()) as chunks:
        async for chunk in chunks:
            for event in stream.feed(chunk, generation.choices[0].num_tokens):
                yield event
            if stream.done:
                break
    for event in stream.finish():
        yield event


async def _sse(events: AsyncGenerator[Event, None],
               ) -> AsyncGenerator[tuple[str, str], None]:
    async with aclosing(events):
        async for name, data in events:
            yield name, json.dumps(data)


@post("/", status_code=200, opt=body_of(MessagesRequest))
async def create_message(request: Request, state: State) -> Response:
    req = decode_body(await request.body(), MessagesRequest)
    chat = chat_request(req)
    generation = await start_chat(state, chat)
    generation.engine.runtime.num_handled += 1
    stream = MessageStream(
        message_id="msg_" + generation.id.removeprefix("chatcmpl-"), model=generation.model,
        num_input_tokens=generation.num_prompt_tokens,
        stop_sequences=list(req.stop_sequences or []), thinking_budget=thinking_budget(req))
    events = _events(generation, stream)
    if req.stream:
        return sse_response(_sse(events))
    collected: list[Event] = []
    async with aclosing(events):
        async for event in events:
            collected.append(event)
    name, data = collected[-1]
    if name == "error":
        raise OpenAIError(500, data["error"]["message"])
    return Response(message_of(collected))


@post("/count_tokens", status_code=200, opt=body_of(MessagesRequest))
async def count_tokens(request: Request, state: State) -> dict:
    """The prompt's tokens as /v1/messages would make them: template, system and tools."""
    chat = chat_request(decode_body(await request.body(), MessagesRequest), counting=True)
    return {"input_tokens": await count_chat_tokens(state, chat)}


# Anthropic's error types by status (it answers overload with 529; this server's 503 keeps
# the status every other route and load balancer here knows).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_response(status_code: int, message: str, headers: dict | None = None) -> Response:
    kind = _ERROR_TYPES.get(status_code) or (
        "invalid_request_error" if status_code < 500 else "api_error")
    return Response({"type": "error", "error": {"type": kind, "message": message}},
                    status_code=status_code, headers=headers)


def _openai_error(_: Request, exc: OpenAIError) -> Response:
    return error_response(exc.status_code, exc.message, exc.headers)


def _http_exception(_: Request, exc: HTTPException) -> Response:
    return error_response(exc.status_code, str(exc.detail))


def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", path=request.url.path, exc_info=exc)
    return error_response(500, "internal server error")


MESSAGES_ROUTER = Router(
    path="/messages", route_handlers=[create_message, count_tokens],
    exception_handlers={OpenAIError: _openai_error, HTTPException: _http_exception,
                        Exception: _internal_error})

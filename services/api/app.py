"""The OpenAI-compatible HTTP front end (litestar): validate, submit, stream.

Chat and text completions share one flow; they differ in how the prompt is given and in the
shape of the response. Text arrives as deltas from the detokenizer; streaming responses pass
them on as Server-Sent Events, others collect them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.response import ServerSentEvent

from bus.messages import FinishReason, GenerateRequest, SamplingParams, TextDelta
from services.api import openai_responses as fmt
from services.api.engine_client import EngineClient
from services.api.errors import EXCEPTION_HANDLERS, OpenAIError, bad_request
from services.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    completion_prompt,
    decode_body,
    sampling_params,
)


@dataclass(frozen=True)
class ApiSettings:
    max_tokens_cap: int = 8192
    max_body_bytes: int = 4 * 2**20


@dataclass
class _Pending:
    """A request admitted by the pipeline whose text has not been fully delivered yet."""

    request_id: str
    created: int
    model: str
    queue: asyncio.Queue
    num_prompt_tokens: int
    chat: bool
    include_usage: bool


def _json(data: Any) -> str:
    return msgspec.json.encode(data).decode()


async def _check_model(engine: EngineClient, model: str) -> str:
    info = await engine.model_info()
    if model != info.model_name:
        raise bad_request(f"the model `{model}` does not exist; this server serves "
                          f"`{info.model_name}`", param="model", code="model_not_found")
    return info.model_name


async def _submit(engine: EngineClient, *, request_id: str, model: str, params: SamplingParams,
                  chat: bool, include_usage: bool, **prompt: Any) -> _Pending:
    admission, queue = await engine.submit(GenerateRequest(
        request_id=request_id, reply_subject=engine.reply_subject, model=model, params=params,
        **prompt))
    return _Pending(request_id, int(time.time()), model, queue, admission.num_prompt_tokens,
                    chat, include_usage)


async def _collect(engine: EngineClient, pending: _Pending) -> Response:
    parts: list[str] = []
    finished = False
    last = TextDelta(request_id=pending.request_id, text="", finish_reason=FinishReason.ERROR)
    try:
        async for delta in engine.deltas(pending.request_id, pending.queue):
            parts.append(delta.text)
            if delta.finish_reason != FinishReason.NONE:
                finished = True
                last = delta
    finally:
        await engine.release(pending.request_id, finished)
    if last.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        raise OpenAIError(500, f"generation failed: {last.error or 'aborted'}")
    text, reason = "".join(parts), fmt.finish_reason_name(last.finish_reason)
    usage = fmt.usage(pending.num_prompt_tokens, last.num_output_tokens)
    build = fmt.chat_completion if pending.chat else fmt.text_completion
    return Response(build(pending.request_id, pending.created, pending.model, text, reason, usage))


async def _stream(engine: EngineClient, pending: _Pending) -> AsyncIterator[str]:
    """SSE data lines; a client that goes away cancels this and the request is aborted."""
    p = pending
    finished = False
    try:
        if p.chat:
            yield _json(fmt.chat_chunk(p.request_id, p.created, p.model,
                                       {"role": "assistant", "content": ""}))
        last: TextDelta | None = None
        async for delta in engine.deltas(p.request_id, p.queue):
            last = delta
            done = delta.finish_reason != FinishReason.NONE
            finished = finished or done
            if done and delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                if delta.text:
                    yield _json(_chunk(p, delta.text, None))
                yield _json({"error": {"message": f"generation failed: "
                                                  f"{delta.error or 'aborted'}",
                                       "type": "server_error", "param": None, "code": None}})
                break
            reason = fmt.finish_reason_name(delta.finish_reason) if done else None
            if delta.text or reason:
                yield _json(_chunk(p, delta.text, reason))
        if p.include_usage and last is not None:
            obj = "chat.completion.chunk" if p.chat else "text_completion"
            yield _json(fmt.usage_chunk(p.request_id, p.created, p.model, obj,
                                        fmt.usage(p.num_prompt_tokens, last.num_output_tokens)))
        yield "[DONE]"
    finally:
        await engine.release(p.request_id, finished)


def _chunk(p: _Pending, text: str, reason: str | None) -> dict:
    if p.chat:
        return fmt.chat_chunk(p.request_id, p.created, p.model,
                              {"content": text} if text else {}, reason)
    return fmt.text_chunk(p.request_id, p.created, p.model, text, reason)


async def _respond(engine: EngineClient, pending: _Pending, stream: bool) -> Response:
    if stream:
        return ServerSentEvent(_stream(engine, pending))
    return await _collect(engine, pending)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Response:
    engine: EngineClient = state.engine
    settings: ApiSettings = state.settings
    req = decode_body(await request.body(), ChatCompletionRequest)
    model = await _check_model(engine, req.model)
    messages = chat_messages(req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = sampling_params(req, max_tokens, 0, settings.max_tokens_cap)
    pending = await _submit(
        engine, request_id=f"chatcmpl-{uuid.uuid4().hex}", model=model, params=params,
        chat=True, include_usage=bool(req.stream_options and req.stream_options.include_usage),
        messages=messages)
    return await _respond(engine, pending, req.stream)


@post("/v1/completions", status_code=200)
async def completions(request: Request, state: State) -> Response:
    engine: EngineClient = state.engine
    settings: ApiSettings = state.settings
    req = decode_body(await request.body(), CompletionRequest)
    model = await _check_model(engine, req.model)
    prompt = completion_prompt(req)
    params = sampling_params(req, req.max_tokens, 16, settings.max_tokens_cap)
    source = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    pending = await _submit(
        engine, request_id=f"cmpl-{uuid.uuid4().hex}", model=model, params=params, chat=False,
        include_usage=bool(req.stream_options and req.stream_options.include_usage), **source)
    return await _respond(engine, pending, req.stream)


@get("/v1/models")
async def models(state: State) -> dict:
    info = await state.engine.model_info()
    return {"object": "list", "data": [{
        "id": info.model_name, "object": "model", "created": 0, "owned_by": "llmbus",
        "max_model_len": info.max_model_len}]}


@get("/health")
async def health(state: State) -> Response:
    stages = await state.engine.stage_health()
    ok = all(stages.values())
    return Response({"status": "ok" if ok else "unavailable", "stages": stages},
                    status_code=200 if ok else 503)


def create_app(engine: EngineClient, settings: ApiSettings | None = None,
               lifespan: Any = None) -> Litestar:
    settings = settings or ApiSettings()

    @asynccontextmanager
    async def state_lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.engine = engine
        app.state.settings = settings
        yield

    return Litestar(
        route_handlers=[chat_completions, completions, models, health],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[state_lifespan] + ([lifespan] if lifespan else []),
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
    )

"""The OpenAI-compatible HTTP front end (litestar): validate, submit, stream.

Chat and text completions share one flow (services/api/generation.py); they differ in how the
prompt is given and in the shape of the response.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from litestar import Litestar, Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers import BaseRouteHandler

from llmbus.bus.messages import EncodeRequest
from llmbus.services.adapter_store_bus import AdapterStore
from llmbus.services.api.adapters import AdapterNames, base_model, resolve_model
from llmbus.services.api.anthropic_messages import MESSAGES_ROUTER
from llmbus.services.api.bodies import decode_body
from llmbus.services.api.chat import include_usage, metrics_for, start_chat
from llmbus.services.api.constraints import output_constraint
from llmbus.services.api.disconnects import abort_on_disconnect
from llmbus.services.api.embeddings import DEFAULT_MAX_INPUTS, EMBEDDING_ROUTES
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.api.errors import EXCEPTION_HANDLERS, OpenAIError, bad_request
from llmbus.services.api.generation import Generation
from llmbus.services.api.lora_routes import LORA_ROUTES, PackAdapter, pack_adapter_files
from llmbus.services.api.openapi import body_of, document_bodies
from llmbus.services.api.pages import PAGE_ROUTES
from llmbus.services.api.pipeline import TokenRates, pipeline_view
from llmbus.services.api.response_store_bus import ResponseStore
from llmbus.services.api.responses_api import RESPONSES_ROUTES
from llmbus.services.api.responses_socket import responses_socket
from llmbus.services.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    chat_messages,
    completion_prompts,
    sampling_params,
    template_kwargs_json,
)
from llmbus.services.api.sse import sse_response


@dataclass(frozen=True)
class ApiSettings:
    limits: Limits = field(default_factory=Limits)
    max_body_bytes: int = 4 * 2**20
    api_key: str | None = None
    trace_url: str | None = None  # a trace viewer's URL with `{trace_id}` in it
    max_embedding_inputs: int = DEFAULT_MAX_INPUTS
    adapter_load_timeout: float = 60.0  # seconds a LoRA load waits for the engines' answers


def _version() -> str:
    try:
        return version("llmbus")
    except PackageNotFoundError:
        return "unknown"


async def _respond(generation: Generation, stream: bool) -> Response:
    generation.engine.runtime.num_handled += 1
    if stream:
        return sse_response(generation.stream())
    return Response(await generation.collect())


@post("/chat/completions", status_code=200, opt=body_of(ChatCompletionRequest))
async def chat_completions(request: Request, state: State) -> Response:
    req = decode_body(await request.body(), ChatCompletionRequest)
    return await _respond(await start_chat(state, req), req.stream)


@post("/completions", status_code=200, opt=body_of(CompletionRequest))
async def completions(request: Request, state: State) -> Response:
    engine: EngineClient = state.engine
    req = decode_body(await request.body(), CompletionRequest)
    choice = await resolve_model(state, req.model)
    prompts = completion_prompts(req, state.settings.limits)
    params = sampling_params(req, max_tokens=req.max_tokens, default_max_tokens=16,
                             num_logprobs=req.logprobs, limits=state.settings.limits)
    params.adapter = choice.adapter
    params.structured, _ = await asyncio.to_thread(output_constraint, req, chat=False)
    echo_texts = None
    if req.echo:
        echo_texts = [p if isinstance(p, str) else await engine.decode(p) for p in prompts]
    sources = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}
               for p in prompts]
    generation = await Generation.start(
        engine, chat=False, model=choice.name, params=params, n=req.n, sources=sources,
        include_usage=include_usage(req), echo_texts=echo_texts,
        metrics=metrics_for(state, choice.base))
    return await _respond(generation, req.stream)


@post("/tokenize", status_code=200, opt=body_of(TokenizeRequest))
async def tokenize(request: Request, state: State) -> dict:
    engine: EngineClient = state.engine
    req = decode_body(await request.body(), TokenizeRequest)
    await base_model(state, req.model)
    info = await engine.model_info()  # cached after the first call
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
    encode = EncodeRequest(add_generation_prompt=req.add_generation_prompt,
                           add_special_tokens=req.add_special_tokens)
    if req.messages is not None:
        encode.messages = chat_messages(req.messages)
        encode.chat_template_kwargs_json = template_kwargs_json(req.chat_template_kwargs)
    else:
        encode.prompt = req.prompt
    token_ids = await engine.encode(encode)
    return {"tokens": token_ids, "count": len(token_ids), "max_model_len": info.max_model_len}


@post("/detokenize", status_code=200, opt=body_of(DetokenizeRequest))
async def detokenize(request: Request, state: State) -> dict:
    engine: EngineClient = state.engine
    req = decode_body(await request.body(), DetokenizeRequest)
    await base_model(state, req.model)
    return {"prompt": await engine.decode(req.tokens)}


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> str:
    """Prometheus text format: every api copy's request metrics, every engine's state."""
    info = await state.engine.model_info()
    registry = metrics_for(state, info.model_name)
    stats, copies = await asyncio.gather(state.engine.stats.engine_stats(),
                                         state.engine.stats.api_metrics())
    registry.set_engine_stats(stats)
    return registry.render(copies)


@get("/pipeline")
async def pipeline(state: State) -> dict:
    """Every stage's live copies, the engines' load, recent requests (the pipeline page)."""
    engine: EngineClient = state.engine
    try:
        model: str | None = (await engine.model_info()).model_name
    except OpenAIError:  # no engine yet: the page still shows who is there
        model = None
    stats, snapshots = await asyncio.gather(engine.stats.engine_stats(),
                                            engine.stats.api_metrics())
    now = time.monotonic()
    rates = {s.engine_id: state.token_rates.observe(s.engine_id, s.num_generated_tokens, now)
             for s in stats}
    return pipeline_view(
        model=model, replica=engine.runtime.instance_id, copies=engine.stats.live_copies(),
        stats=stats, rates=rates, recent=[r for c in snapshots for r in c.recent_requests],
        trace_url=state.settings.trace_url)


@get("/health")
async def health(state: State) -> Response:
    """200 when every stage answers ready; 503 otherwise (a load balancer stops sending)."""
    pipeline_stats = state.engine.stats
    stages = await pipeline_stats.stage_health()
    ok = all(stages.values()) and not state.get("draining", False)
    return Response({"status": "ok" if ok else "unavailable", "stages": stages,
                     "copies": pipeline_stats.num_copies()}, status_code=200 if ok else 503)


@get("/version")
async def version_route() -> dict:
    return {"version": _version()}


def _same_key(sent: str, expected: str) -> bool:
    """Constant-time comparison of bytes: header text arrives as latin-1-decoded bytes, and
    `compare_digest` raises on non-ASCII `str` (which made a stray byte a 500)."""
    try:
        raw = sent.encode("latin-1")
    except UnicodeEncodeError:
        raw = sent.encode("utf-8")
    return hmac.compare_digest(raw, expected.encode("utf-8"))


def _require_api_key(connection: ASGIConnection, _handler: BaseRouteHandler) -> None:
    expected = connection.app.state.settings.api_key
    if expected is None:
        return
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    # Anthropic's clients send the key as `x-api-key`; either header may carry it.
    sent = [token.strip()] if scheme.lower() == "bearer" else []
    sent += connection.headers.getall("x-api-key", [])
    if not any(_same_key(key, expected) for key in sent):
        raise OpenAIError(401, "missing or invalid API key: send `Authorization: Bearer <key>` "
                          "or `x-api-key: <key>`", code="invalid_api_key")


def create_app(engine: EngineClient, settings: ApiSettings | None = None, *,
               response_store: ResponseStore | None = None,
               adapter_store: AdapterStore | None = None,
               pack_adapter: PackAdapter = pack_adapter_files) -> Litestar:
    """`response_store`: the bus's stored responses, None where they are off;
    `adapter_store`: the bus's LoRA adapters, None where they are off (the base alone serves);
    `pack_adapter`: what makes a blob of the adapter at a path."""
    settings = settings or ApiSettings()

    @asynccontextmanager
    async def state_lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.engine = engine
        app.state.settings = settings
        app.state.response_store = response_store
        app.state.adapter_store = adapter_store
        app.state.adapter_names = AdapterNames()
        app.state.pack_adapter = pack_adapter
        app.state.token_rates = TokenRates()
        document_bodies(app)
        yield

    v1 = Router(path="/v1", route_handlers=[chat_completions, completions, *LORA_ROUTES, pipeline,
                                            *RESPONSES_ROUTES, responses_socket, MESSAGES_ROUTER,
                                            *EMBEDDING_ROUTES],
                guards=[_require_api_key])
    return Litestar(
        route_handlers=[v1, tokenize, detokenize, health, version_route, metrics,
                        *PAGE_ROUTES],
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[abort_on_disconnect],
        lifespan=[state_lifespan],
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,  # structlog owns logging (bus/logging.py)
    )

"""Starting a chat generation: the one path that every dialect's chat-shaped request takes
(`/v1/chat/completions`, and the Responses and Messages APIs, which translate to it)."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar.datastructures import State

from llmbus.services.api.constraints import output_constraint
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.api.errors import bad_request
from llmbus.services.api.generation import Generation
from llmbus.services.api.metrics import ApiMetrics
from llmbus.services.api.schemas import (
    ChatCompletionRequest,
    chat_logprobs,
    chat_messages,
    sampling_params,
    template_kwargs_json,
)


async def check_model(engine: EngineClient, model: str | None) -> str:
    info = await engine.model_info()
    if model is not None and model != info.model_name:
        raise bad_request(f"the model `{model}` does not exist; this server serves "
                          f"`{info.model_name}`", param="model", code="model_not_found")
    return info.model_name


def metrics_for(state: State, model: str) -> ApiMetrics:
    """This api copy's request metrics (made on first use, when the model's name is known)."""
    if state.get("metrics") is None:
        registry = state.metrics = ApiMetrics(model, state.engine.runtime.instance_id)
        state.engine.migrations.on_migrated = registry.migrations.labels(*registry.labels).inc
    return state.metrics


def include_usage(req: Any) -> bool:
    if req.stream_options is not None and not req.stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`",
                          param="stream_options")
    return bool(req.stream_options and req.stream_options.include_usage)


async def start_chat(state: State, req: ChatCompletionRequest) -> Generation:
    """Validate a chat request and admit it into the pipeline."""
    engine: EngineClient = state.engine
    model = await check_model(engine, req.model)
    messages = chat_messages(req.messages)
    params = sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                             default_max_tokens=0, num_logprobs=chat_logprobs(req),
                             limits=state.settings.limits)
    # Compiling a big schema to check it takes a while: not on the event loop.
    params.structured, tools = await asyncio.to_thread(output_constraint, req, chat=True)
    return await Generation.start(
        engine, chat=True, model=model, params=params, n=req.n,
        sources=[{"messages": messages, "tools_json": tools.tools_json if tools else "",
                  "chat_template_kwargs_json": template_kwargs_json(req.chat_template_kwargs)}],
        include_usage=include_usage(req), metrics=metrics_for(state, model), tools=tools)

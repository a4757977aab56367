"""Starting a chat generation: the one path that every dialect's chat-shaped request takes
(`/v1/chat/completions`, and the Responses and Messages APIs, which translate to it)."""

from __future__ import annotations

import asyncio
from typing import Any

from litestar.datastructures import State

from llmbus.bus.messages import EncodeRequest
from llmbus.services.api.adapters import resolve_model
from llmbus.services.api.constraints import output_constraint, tool_use
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


async def check_model(state: State, model: str | None) -> str:
    """The base model's name, for the routes that only the base serves (embeddings, score):
    a LoRA adapter's name is a 400 there, any other name a 404."""
    choice = await resolve_model(state, model)
    if choice.adapter:
        raise bad_request(f"`{choice.adapter}` is a LoRA adapter; this route serves the base "
                          f"model `{choice.base}` only", param="model",
                          code="model_not_supported")
    return choice.name


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
    choice = await resolve_model(state, req.model)
    messages = chat_messages(req.messages)
    params = sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                             default_max_tokens=0, num_logprobs=chat_logprobs(req),
                             limits=state.settings.limits)
    params.adapter = choice.adapter
    # Compiling a big schema to check it takes a while: not on the event loop.
    params.structured, tools = await asyncio.to_thread(output_constraint, req, chat=True)
    return await Generation.start(
        engine, chat=True, model=choice.name, params=params, n=req.n,
        sources=[{"messages": messages, "tools_json": tools.tools_json if tools else "",
                  "chat_template_kwargs_json": template_kwargs_json(req.chat_template_kwargs),
                  "continue_final_message": req.continue_final_message}],
        include_usage=include_usage(req), metrics=metrics_for(state, choice.base), tools=tools)


async def count_chat_tokens(state: State, req: ChatCompletionRequest) -> int:
    """The prompt's tokens as `start_chat` would make them: template, messages and tools (an
    adapter counts as its base)."""
    await resolve_model(state, req.model)
    tools, _ = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)
    token_ids = await state.engine.encode(EncodeRequest(
        messages=chat_messages(req.messages), tools_json=tools.tools_json if tools else "",
        chat_template_kwargs_json=template_kwargs_json(req.chat_template_kwargs),
        continue_final_message=req.continue_final_message))
    return len(token_ids)

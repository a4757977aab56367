"""The models this server serves and the LoRA adapters among them, over HTTP: `/v1/models`
(the base, then every adapter in the bus's store, `parent` the base), `/v1/models/{id}`, and
vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (same names, same
bodies, same plain-text answers), behind the api key as every /v1 route.

Loading reads the adapter where the api runs (`lora_path`), packs it (one blob, the format the
executors read), stores it in the bus's adapter store, then tells every engine to load it and
waits for their answers: one engine's refusal (its base, shapes or targets do not fit) undoes
the load, as does no engine serving adapters at all. Engines on other hosts read the bytes from
the store, never the path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog
from litestar import MediaType, Request, get, post
from litestar.datastructures import State
from litestar.params import FromPath

from llmbus.services.adapter_store_bus import AdapterStore, AdapterStoreUnavailable, check_name
from llmbus.services.api.adapters import load_refusal, resolve_model, store_unavailable
from llmbus.services.api.adapters_bus import command_engines
from llmbus.services.api.bodies import decode_body
from llmbus.services.api.errors import OpenAIError, bad_request
from llmbus.services.api.openapi import body_of

log = structlog.get_logger()

PackAdapter = Callable[[str], bytes]


class LoadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name


class UnloadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


def pack_adapter_files(path: str) -> bytes:
    """The adapter at `path` (a PEFT folder, or a GGUF adapter) as the blob engines read.
    Imported when first needed: numpy and the GGUF reader are no part of the api's start."""
    from llmbus.services.adapter_files import pack_adapter

    return pack_adapter(path)


def _model(model_id: str, base: str, max_model_len: int) -> dict:
    adapter = model_id != base
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "llmbus",
            "root": base, "parent": base if adapter else None, "max_model_len": max_model_len}


async def _adapter_names(state: State) -> list[str]:
    store: AdapterStore | None = state.adapter_store
    if store is None:
        return []
    try:
        return await store.names()
    except AdapterStoreUnavailable as exc:  # the base still serves: list it
        log.warning("adapters not listed", reason=str(exc))
        return []


@get("/models")
async def models(state: State) -> dict:
    info = await state.engine.model_info()
    names = [info.model_name, *await _adapter_names(state)]
    return {"object": "list",
            "data": [_model(name, info.model_name, info.max_model_len) for name in names]}


@get("/models/{model_id:path}")
async def model(model_id: FromPath[str], state: State) -> dict:
    info = await state.engine.model_info()
    choice = await resolve_model(state, model_id.removeprefix("/"))
    return _model(choice.name, info.model_name, info.max_model_len)


def _store(state: State) -> AdapterStore:
    store: AdapterStore | None = state.adapter_store
    if store is None:
        raise OpenAIError(503, "LoRA adapters are off: the bus's adapter store could not be "
                          "opened (the api's log says why)")
    return store


def _pack(pack: PackAdapter, path: str) -> bytes:
    """The adapter's blob; a 400 naming `lora_path` when it cannot be read or is no
    adapter (pack_adapter's ValueError is one line saying what does not fit)."""
    if not Path(path).exists():
        raise bad_request(f"`lora_path` {path!r} does not exist where the api runs",
                          param="lora_path")
    try:
        return pack(path)
    except ValueError as exc:
        raise bad_request(str(exc), param="lora_path") from None
    except OSError as exc:
        raise bad_request(f"cannot read `lora_path` {path!r}: {exc.strerror or exc}",
                          param="lora_path") from None


async def _check_new_name(state: State, store: AdapterStore, name: str) -> None:
    try:
        check_name(name)
    except ValueError as exc:
        raise bad_request(str(exc), param="lora_name") from None
    if name == (await state.engine.model_info()).model_name:
        raise bad_request(f"`{name}` is the base model's name", param="lora_name")
    if await store.has(name):
        raise bad_request(f"The lora adapter '{name}' has already been loaded; unload it "
                          "first", param="lora_name")


@post("/load_lora_adapter", status_code=200, media_type=MediaType.TEXT,
      opt=body_of(LoadLoraAdapterRequest))
async def load_lora_adapter(request: Request, state: State) -> str:
    req = decode_body(await request.body(), LoadLoraAdapterRequest)
    if req.load_inplace:
        raise bad_request("`load_inplace` is not supported: unload the adapter, then load it",
                          param="load_inplace", code="unsupported_parameter")
    store, name, timeout = _store(state), req.lora_name, state.settings.adapter_load_timeout
    try:
        await _check_new_name(state, store, name)
        blob = await asyncio.to_thread(_pack, state.pack_adapter, req.lora_path)
        await store.put(name, blob)
        engine_ids, replies = await command_engines(state.engine.stats, name, "load", timeout)
        refusal = load_refusal(replies, engine_ids, timeout)
        if refusal is not None:
            await store.delete(name)
            await command_engines(state.engine.stats, name, "unload", timeout)
            raise refusal
    except AdapterStoreUnavailable as exc:
        raise store_unavailable(exc) from None
    state.adapter_names.found(name, time.monotonic())
    log.info("LoRA adapter loaded", adapter=name, num_bytes=len(blob),
             engines=sorted(r.engine_id for r in replies if r.enabled))
    return f"Success: LoRA adapter '{name}' added successfully."


@post("/unload_lora_adapter", status_code=200, media_type=MediaType.TEXT,
      opt=body_of(UnloadLoraAdapterRequest))
async def unload_lora_adapter(request: Request, state: State) -> str:
    req = decode_body(await request.body(), UnloadLoraAdapterRequest)
    store, name = _store(state), req.lora_name
    try:
        deleted = await store.delete(name)
    except AdapterStoreUnavailable as exc:
        raise store_unavailable(exc) from None
    state.adapter_names.forget(name)
    if not deleted:
        raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                          code="model_not_found")
    if state.get("metrics") is not None:
        state.metrics.forget_adapter(name)
    _, replies = await command_engines(state.engine.stats, name, "unload",
                                       state.settings.adapter_load_timeout)
    for reply in replies:
        if reply.error:  # the store no longer has it: no request can ask for it again
            log.warning("an engine did not unload", adapter=name, engine_id=reply.engine_id,
                        error=reply.error)
    log.info("LoRA adapter unloaded", adapter=name)
    return f"Success: LoRA adapter '{name}' removed successfully."


LORA_ROUTES = [models, model, load_lora_adapter, unload_lora_adapter]

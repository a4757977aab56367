"""Stored responses as the Responses routes read them: the record kept per response, and its
loading, with the 404 or 503 that a client gets when it cannot be had."""

from __future__ import annotations

import msgspec
from litestar.datastructures import State

from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.response_store_bus import ResponseStore, ResponseStoreUnavailable
from llmbus.services.api.schemas import ChatMessageIn


class StoredResponse(msgspec.Struct):
    """What the store keeps per response: the object GET returns, and the conversation up to
    and including it (chat messages), which `previous_response_id` continues."""

    response: dict
    conversation: list[dict]
    input_items: list[dict] = []  # this turn's input, with ids: GET .../input_items


def not_found(response_id: str, param: str | None) -> OpenAIError:
    return OpenAIError(404, f"no stored response has the id {response_id!r} (it may have "
                       "been deleted, or expired: --responses-ttl)", param=param,
                       code="previous_response_not_found" if param else "response_not_found")


def store_of(state: State) -> ResponseStore | None:
    return state.get("response_store")


async def load_stored(state: State, response_id: str, param: str | None) -> StoredResponse:
    store = store_of(state)
    if store is None:
        raise OpenAIError(503, "stored responses are unavailable: the bus has no JetStream "
                          "store (run nats-server with JetStream; `llmbus up` does)", param=param)
    try:
        raw = await store.get(response_id)
    except ResponseStoreUnavailable as exc:
        raise OpenAIError(503, f"stored responses are unavailable: {exc}", param=param) from None
    if raw is None:
        raise not_found(response_id, param)
    return msgspec.json.decode(raw, type=StoredResponse)


async def history_of(state: State, previous_response_id: str | None) -> list[ChatMessageIn]:
    """The conversation that `previous_response_id` continues (none without one)."""
    if previous_response_id is None:
        return []
    previous = await load_stored(state, previous_response_id, "previous_response_id")
    return msgspec.convert(previous.conversation, list[ChatMessageIn])

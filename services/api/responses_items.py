"""A Responses request's input as the items `GET /v1/responses/{id}/input_items` lists, and
that list's pages (OpenAI's cursor pagination: `after`, `limit`, `order`). Pure."""

from __future__ import annotations

from typing import Any

from llmbus.services.api.errors import bad_request
from llmbus.services.api.responses_output import new_id

_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs", "compaction": "cmp"}
MAX_PAGE = 100


def input_items(value: str | list[Any]) -> list[dict]:
    """The input as items, each with an id (the client's, or one made here) and a message's
    text as content parts."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for given in value:
        item = {"type": "message", **given}
        item.setdefault("id", new_id(_ID_PREFIXES.get(item["type"], "item")))
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
        items.append(item)
    return items


def page(items: list[dict], *, after: str | None, limit: str | None,
         order: str | None) -> dict:
    """One page of `items` (kept oldest first), newest first unless `order=asc`."""
    try:
        size = 20 if limit is None else int(limit)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_PAGE:
        raise bad_request(f"`limit` must be an integer from 1 to {MAX_PAGE}", param="limit")
    if order not in (None, "asc", "desc"):
        raise bad_request("`order` must be `asc` or `desc`", param="order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"no input item has the id {after!r}", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + size]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + size < len(ordered)}

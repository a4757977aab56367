"""JSON request bodies, decoded by one rule on every route and dialect.

- A top-level `null` means "not given": the field takes its default (the OpenAI spec marks
  most optional fields nullable, and clients generated from it send them so). A required
  field sent as `null` is missing, and its 400 says so.
- Numbers are taken as pydantic's lax mode (vLLM's) takes them: an integral float (`16.0`) is
  an integer, a numeric string a number; anything else of the wrong type is a 400.
- Integers are bounded where they enter (`Int`, `TokenId`): a value past 64 bits cannot
  cross the bus, so it is a 400 naming the parameter, never a 500 from the encoder.
- Every 400 names the parameter it is about (`param`), the first path segment of the error.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec

from llmbus.services.api.errors import bad_request

T = TypeVar("T")

# What the bus carries: signed 64-bit integers (seed is int64, as vLLM bounds it).
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# A token id the bus can carry; the tokenizer stage checks it against the vocabulary.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
MAX_TOKEN_ID = 2**63 - 1

_PARAM = (re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)"),
          re.compile(r"(?:missing required|unknown) field `([A-Za-z_][A-Za-z0-9_]*)`"))


def decode_body(body: bytes, request_type: type[T]) -> T:
    """The body as `request_type`, or a 400 naming what is wrong with it."""
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    return convert(value, request_type)


def convert(value: dict[str, Any], request_type: type[T]) -> T:
    """A decoded JSON object as `request_type`, by the rules above."""
    given = {key: item for key, item in value.items() if item is not None}
    try:
        return msgspec.convert(given, request_type, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        found = next((m for m in (p.search(message) for p in _PARAM) if m), None)
        raise bad_request(f"invalid request: {message}",
                          param=found.group(1) if found else None) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_items(value: str | list[Any], param: str, max_items: int,
                 limit_hint: str = "") -> list[str | list[int]]:
    """A `str | list[str] | list[int] | list[list[int]]` field (a completion's `prompt`, an
    embedding's `input`) as its items: each a non-empty string or non-empty token ids."""
    if isinstance(value, str) or (value and all(_is_int(t) for t in value)):
        items: list[Any] = [value]
    else:
        items = value
    if not items:
        raise bad_request(f"`{param}` must not be empty", param=param)
    if len(items) > max_items:
        raise bad_request(f"at most {max_items} items in `{param}` per request{limit_hint}, "
                          f"got {len(items)}", param=param)
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request(f"`{param}` must not hold an empty string", param=param)
        elif not (isinstance(item, list) and item and all(_is_int(t) for t in item)):
            raise bad_request(f"`{param}` must be a string, a list of strings, a list of token "
                              "ids or a list of token-id lists", param=param)
        elif not all(0 <= t <= MAX_TOKEN_ID for t in item):
            raise bad_request(f"`{param}`: token ids are between 0 and the vocabulary's size",
                              param=param)
    return items

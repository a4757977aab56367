"""A bounded fuzz run against the server's own OpenAPI document (`/schema/openapi.json`):
bodies for every documented route, made of the fields its schema names with values of any
JSON shape (nulls, integral floats, integers past 64 bits, wrong types), never get a 5xx.
A longer run is the same test with `--hypothesis-seed` and more examples
(HYPOTHESIS_MAX_EXAMPLES, below)."""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.stack import AUTH, MODEL_NAME

pytestmark = pytest.mark.model

EXAMPLES = int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "80"))
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.sampled_from([0, 1, -1, 2**63, -(2**63) - 1, 16.0, 0.0, 2**64])
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda children: st.lists(children, max_size=3) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "name", "include_usage"]) | st.text(
        max_size=6), children, max_size=3), max_leaves=8)
CAPPED = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n")  # keep it short
SKIPPED = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}  # the shared stack has no LoRA


@pytest.fixture(scope="module")
def routes(stack) -> list[tuple[str, list[str]]]:
    """(path, the fields its body schema names) of every documented route with a body."""
    root = stack.base_url.removesuffix("/v1")
    document = httpx.get(f"{root}/schema/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    found = []
    for path, operations in sorted(document["paths"].items()):
        body = operations.get("post", {}).get("requestBody")
        if body is None or path in SKIPPED:
            continue
        name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        found.append((path, sorted(schemas[name]["properties"])))
    assert len(found) >= 10
    return found


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_documented_route_answers_a_5xx(stack, routes, data):
    path, fields = data.draw(st.sampled_from(routes))
    body = data.draw(st.dictionaries(st.sampled_from(fields), VALUES, max_size=6))
    if data.draw(st.booleans()):
        body["model"] = MODEL_NAME
    for name in CAPPED:
        if isinstance(body.get(name), int | float) and not isinstance(body[name], bool):
            body[name] = min(abs(int(body[name])), 4) or 1
    body.pop("stream", None)  # streams are covered elsewhere; each example stays short
    url = stack.base_url.removesuffix("/v1") + path
    response = httpx.post(url, json=body, headers=AUTH, timeout=120)
    assert response.status_code < 500, (path, body, response.text)

"""The OpenAPI document carries the request body of every route that takes one, as the
struct that parses it describes it (services/api/openapi.py)."""

from __future__ import annotations

from llmbus.services.api.app import create_app
from llmbus.services.api.openapi import document_bodies
from llmbus.services.api.schemas import ChatCompletionRequest

BODIED = {"/v1/chat/completions", "/v1/completions", "/v1/responses",
          "/v1/responses/input_tokens", "/v1/responses/compact", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/embeddings", "/v1/score", "/v1/load_lora_adapter",
          "/v1/unload_lora_adapter", "/tokenize", "/detokenize"}


def _document() -> dict:
    app = create_app(None)  # type: ignore[arg-type]  (no bus: the document needs none)
    document_bodies(app)
    from litestar._openapi.plugin import OpenAPIPlugin

    return app.plugins.get(OpenAPIPlugin).provide_openapi_schema()


def test_every_route_that_takes_a_body_documents_it():
    document = _document()
    with_body = {path for path, operations in document["paths"].items()
                 if any("requestBody" in op for op in operations.values())}
    assert with_body == BODIED


def test_a_body_is_its_struct_schema():
    document = _document()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert ref.endswith(ChatCompletionRequest.__name__)
    assert set(schema["required"]) == {"model", "messages"}
    assert schema["properties"]["seed"]["anyOf"][0]["minimum"] == -(2**63)

"""The OpenAPI document (`/schema/openapi.json`) with the request body of every route that
takes one, generated from the msgspec structs that parse it, so that a generated client or a
fuzzer (schemathesis) can use it.

Handlers read their bodies themselves (bodies.py: one decoding rule, errors that name the
parameter), so litestar sees no body to document; a handler names its struct in its `opt`
(`opt={"body": ChatCompletionRequest}`) and `document_bodies` adds it to litestar's document
once, at start-up. Response bodies are not described: they are built as dicts today.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin
from litestar.routes import HTTPRoute

REF = "#/components/schemas/{name}"


def body_of(struct: type) -> dict[str, Any]:
    """A handler's `opt` that documents `struct` as its JSON body."""
    return {"body": struct}


def document_bodies(app: Litestar) -> None:
    """Add each documented route's request body, and the schemas it refers to, to the
    document litestar serves (which it builds once and keeps)."""
    plugin = app.plugins.get(OpenAPIPlugin)
    document = plugin.provide_openapi_schema()
    bodies: dict[tuple[str, str], type] = {}
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for handler in route.route_handlers:
            body = handler.opt.get("body")
            for verb in handler.http_methods if body is not None else ():
                bodies[(route.path_format, str(verb).lower())] = body  # type: ignore[assignment]
    if not bodies:
        return
    refs, components = msgspec.json.schema_components(list(bodies.values()), ref_template=REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(components)
    for (path, method), ref in zip(bodies, refs, strict=True):
        operation = document.get("paths", {}).get(path, {}).get(method)
        if operation is not None:
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": ref}}}

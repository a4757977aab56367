"""OpenTelemetry set-up and W3C trace context on the bus, so one request is one trace.

A message addressed to one request carries the context in its NATS headers (the runtime
injects and extracts it). A batched message (one engine step, many requests) cannot: there,
each request's context travels in the message as a `traceparent` string.
"""

from __future__ import annotations

import os

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, SpanContext

_provider: TracerProvider | None = None


def configure_tracing(service: str, instance_id: str, *, console: bool = False) -> None:
    """Install an SDK tracer provider: OTLP/HTTP export when the standard OTEL_* variables
    name an endpoint, console export when asked, otherwise spans are made and dropped."""
    global _provider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create(
        {"service.name": f"llmbus-{service}", "service.instance.id": instance_id}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown_tracing() -> None:
    """Flush spans still buffered (a service that exits must not lose its last spans)."""
    if _provider is not None:
        _provider.shutdown()


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's context (traceparent/tracestate)."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract_context(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})


def current_traceparent() -> str:
    """The current span's context as a W3C `traceparent` string ("" when none)."""
    return inject_headers().get("traceparent", "")


def context_from_traceparent(traceparent: str) -> context.Context:
    return propagate.extract({"traceparent": traceparent} if traceparent else {})


def link_to(traceparent: str) -> Link | None:
    """A span link to the request whose context is `traceparent` (None if it has none)."""
    span_context: SpanContext = trace.get_current_span(
        context_from_traceparent(traceparent)).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def trace_id_hex() -> str | None:
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None

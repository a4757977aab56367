"""W3C trace context carried in NATS message headers, so one request is one trace.

Spans beyond propagation (per-stage spans, exporters, metrics) are the observability issue's
work; this module is the seam every service already calls.
"""

from __future__ import annotations

import os

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider


def configure_tracing(service: str, instance_id: str) -> None:
    """Install an SDK tracer provider; export over OTLP only when OTEL_* says where."""
    provider = TracerProvider(resource=Resource.create(
        {"service.name": f"llmbus-{service}", "service.instance.id": instance_id}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's context (traceparent/tracestate)."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract_context(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})

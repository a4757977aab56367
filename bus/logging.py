"""structlog set-up shared by every service: console lines by default, JSON lines on request.

Every line carries the service name and replica (instance id); lines logged inside a span
carry its trace id; request-scoped lines bind `request_id` (``log.bind(request_id=...)`` or
``structlog.contextvars.bound_contextvars``). Standard-library logging (uvicorn, nats) goes
through the same renderer.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from llmbus.bus.tracing import trace_id_hex


def _add_trace_id(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    if "trace_id" not in event:
        trace_id = trace_id_hex()
        if trace_id is not None:
            event["trace_id"] = trace_id
    return event


def configure_logging(service: str, instance_id: str, *, fmt: str = "console",
                      level: str = "info") -> structlog.stdlib.BoundLogger:
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_id,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(logging.getLevelName(level.upper()), logging.INFO))
    structlog.contextvars.bind_contextvars(service=service, replica=instance_id)
    return structlog.get_logger()

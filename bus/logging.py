"""structlog set-up shared by every service: console lines by default, JSON lines on request.

Every line carries the service name and instance id; request-scoped lines bind `request_id`
(``log.bind(request_id=...)``).
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, instance_id: str, *, fmt: str = "console",
                      level: str = "info") -> structlog.stdlib.BoundLogger:
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, instance=instance_id)
    return structlog.get_logger()

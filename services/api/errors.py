"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

Every failure the api returns goes through here, including litestar's own (unknown route,
wrong method, oversized body) and anything unexpected (500 without a stack trace).
"""

from __future__ import annotations

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

log = structlog.get_logger()

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class OpenAIError(Exception):
    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status_code, self.message, self.param, self.code)


def error_body(status_code: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status_code, "server_error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def openai_error_handler(_: Request, exc: OpenAIError) -> Response:
    return Response(exc.body(), status_code=exc.status_code, headers=exc.headers)


def http_exception_handler(_: Request, exc: HTTPException) -> Response:
    return Response(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", path=request.url.path, exc_info=exc)
    return Response(error_body(500, "internal server error"), status_code=500)


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    OpenAIError: openai_error_handler,
    HTTPException: http_exception_handler,
    Exception: internal_error_handler,
}

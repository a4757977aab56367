"""The browser pages: a chat at `/` and the live pipeline at `/pipeline`.

Plain HTML, CSS and JS modules in static/ (no build step, nothing loaded from elsewhere) that
call the same JSON routes as any client: `/v1/chat/completions` streamed, `/v1/models`,
`/v1/pipeline`. The pages embed no data, so they need no key: with `--api-key` set, they ask for
it, keep it in the browser, and every call they make carries it.
"""

from __future__ import annotations

from pathlib import Path

from litestar import Response, get
from litestar.exceptions import NotFoundException
from litestar.params import FromPath

PAGES_DIR = Path(__file__).resolve().parent / "static"
_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8"}
ASSETS = ("llmbus.css", "common.js", "markdown.js", "chat.js", "pipeline.js")
# Scripts and styles from this server only, no inline code: text a model writes can never run.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                                       "frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def _file(name: str) -> Response[bytes]:
    path = PAGES_DIR / name
    return Response(path.read_bytes(), media_type=_MEDIA_TYPES[path.suffix], headers=_HEADERS)


@get("/", include_in_schema=False)
async def chat_page() -> Response[bytes]:
    return _file("chat.html")


@get("/pipeline", include_in_schema=False)
async def pipeline_page() -> Response[bytes]:
    return _file("pipeline.html")


@get("/static/{name:str}", include_in_schema=False)
async def asset(name: FromPath[str]) -> Response[bytes]:
    if name not in ASSETS:
        raise NotFoundException(f"no file `{name}` here")
    return _file(name)


PAGE_ROUTES = [chat_page, pipeline_page, asset]

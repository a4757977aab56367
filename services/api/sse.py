"""Server-Sent Events as OpenAI's servers write them: every line ends with `\\n`.

litestar's own encoder ends lines with `\\r\\n`, which SSE allows but hand-written readers
(the OpenResponses compliance suite's among them) that split on `\\n` do not take. Data here is
one line of JSON, so each event is `event: NAME\\n` (if named), `data: ...\\n`, then `\\n`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar.response import Stream


def sse_response(events: AsyncIterator[tuple[str | None, str]]) -> Stream:
    """A `text/event-stream` response of (event name or None, one-line data) pairs."""
    return Stream(_encoded(events), media_type="text/event-stream", headers={
        "Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"})


async def _encoded(events: AsyncIterator[tuple[str | None, str]]) -> AsyncIterator[bytes]:
    async for name, data in events:
        assert "\n" not in data and "\r" not in data, "SSE data is one line of JSON here"
        head = f"event: {name}\n" if name else ""
        yield f"{head}data: {data}\n\n".encode()

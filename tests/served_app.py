"""An api app served by uvicorn in the test's own event loop (where its bus client lives too),
on a free port: what the api tests without the model share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from litestar import Litestar

from llmbus.services.launcher import free_port


@asynccontextmanager
async def served(app: Litestar) -> AsyncIterator[str]:
    """Yields the app's root URL once it listens; stops it (lifespan and all) on leaving."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="on"))
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving

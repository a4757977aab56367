"""A real browser for the page tests (tests/e2e/test_web_pages.py, tests/api/test_lora_pages.py):
Debian's chromium, headless, driven by Playwright (never `playwright install`, which downloads
a browser build), and screenshots kept in test-artifacts/web/ (or $LLMBUS_TEST_ARTIFACTS/web/)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.stack import REPO

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("LLMBUS_TEST_ARTIFACTS", REPO / "test-artifacts")) / "web"


@asynccontextmanager
async def chromium() -> AsyncIterator[Any]:
    """A headless chromium (Playwright's Browser), closed on leaving."""
    from playwright.async_api import async_playwright  # only where a browser runs

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        try:
            yield browser
        finally:
            await browser.close()


async def screenshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=True)

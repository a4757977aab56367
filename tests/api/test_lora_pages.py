"""The pages' LoRA parts in a real browser (Debian's chromium, headless, driven by Playwright),
without the model: the real api on a real nats-server, the other stages stood in for
(tests/lora_fakes.py). The chat page's model picker lists what /v1/models lists and sends the
model picked; the pipeline page shows each executor's resident adapters. Screenshots go where
tests/browser.py keeps them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, chromium, screenshot
from tests.bus_users import connect_as
from tests.lora_fakes import KEY, MODEL, lora_world, wait_for_engines, write_adapter

pytestmark = [pytest.mark.adapter,  # a real nats-server, no model
              pytest.mark.skipif(not Path(CHROMIUM).is_file()
                                 or importlib.util.find_spec("playwright") is None,
                                 reason="no chromium or no playwright")]


@pytest.fixture(scope="module")
async def browser():
    async with chromium() as browser:
        yield browser


@pytest.fixture
async def served(monkeypatch, tmp_path, browser, request):
    """An api copy with one engine and the adapter `sql-lora` loaded, and a browser page that
    holds the API key."""
    async with lora_world(connect_as(monkeypatch)) as world:
        await world.engine("e1")
        http = await world.api()
        await wait_for_engines(http, {"e1"})
        loaded = await http.post("/v1/load_lora_adapter", json={
            "lora_name": "sql-lora", "lora_path": write_adapter(tmp_path / "sql")})
        assert loaded.status_code == 200, loaded.text
        context = await browser.new_context(viewport={"width": 1280, "height": 860})
        await context.add_init_script(f"localStorage.setItem('llmbus.apiKey', '{KEY}')")
        page = await context.new_page()
        page.set_default_timeout(30_000)
        try:
            yield world, str(http.base_url).rstrip("/"), page
        finally:
            await screenshot(page, request.node.name)
            await context.close()


async def test_the_chat_page_picks_an_adapter_and_keeps_the_choice(served):
    from playwright.async_api import expect

    world, base, page = served
    await page.goto(base + "/")
    options = page.locator("#model option")
    await expect(options).to_have_count(2)
    assert await options.evaluate_all("os => os.map(o => [o.value, o.textContent])") == [
        [MODEL, MODEL], ["sql-lora", "sql-lora (LoRA)"]]
    assert await page.input_value("#model") == MODEL  # the base, until one picks
    await page.select_option("#model", "sql-lora")
    await page.fill("#prompt", "hello")
    await page.press("#prompt", "Enter")
    answer = page.locator("#messages .message.assistant:last-child .body")
    await expect(answer).to_have_text("Hello world")
    assert (world.pipeline.requests[-1].model,
            world.pipeline.requests[-1].params.adapter) == ("sql-lora", "sql-lora")
    await page.reload()
    await expect(options).to_have_count(2)
    assert await page.input_value("#model") == "sql-lora"


async def test_the_pipeline_page_shows_an_executors_resident_adapters(served):
    from playwright.async_api import expect

    _, base, page = served
    await page.goto(base + "/pipeline")
    row = page.locator('.stage[data-stage="executor"] tr.copy')
    await expect(row).to_have_count(1)
    await expect(row.locator("td.adapters")).to_have_text("sql-lora")

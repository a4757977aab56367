"""The chat page (`/`) and the pipeline page (`/pipeline`) in a real browser: Debian's
chromium, headless, driven by Playwright, against a real stack of two copies of every stage
behind an API key (conftest's two_of_each). Each test keeps a screenshot in
test-artifacts/web/ (or $LLMBUS_TEST_ARTIFACTS/web/)."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from playwright.async_api import expect

from tests.browser import CHROMIUM, chromium, screenshot
from tests.stack import API_KEY, AUTH, MODEL_NAME, needs_default_model

pytestmark = [pytest.mark.model, needs_default_model()]

WAIT_MS = 120_000  # a busy 2-core machine: answers and heartbeats may be slow
# Records the last assistant message's text at every animation frame where it changed: what
# the user saw painted, in order.
RECORD_PAINTS = """() => {
  window.paints = [];
  const tick = () => {
    const body = document.querySelector('#messages .message.assistant:last-child .body');
    const text = body ? body.textContent : '';
    if (text && window.paints[window.paints.length - 1] !== text) window.paints.push(text);
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""


@pytest.fixture(scope="module")
def web_stack(two_of_each):
    """conftest's two copies of every stage, behind an API key (test_replicas used them
    before; the last test here kills a detokenizer copy)."""
    if not Path(CHROMIUM).is_file():
        pytest.skip("no chromium: `apt-get install chromium` (./dev test does it as root)")
    stack, root, _ = two_of_each
    return stack, root


@pytest.fixture(scope="module")
async def browser():
    async with chromium() as browser:
        yield browser


@pytest.fixture
async def page(browser, request):
    """A page whose browser already holds the API key (as after entering it once)."""
    context = await browser.new_context(viewport={"width": 1280, "height": 860})
    await context.add_init_script(f"localStorage.setItem('llmbus.apiKey', '{API_KEY}')")
    page = await context.new_page()
    page.set_default_timeout(WAIT_MS)
    yield page
    await screenshot(page, request.node.name)
    await context.close()


async def _settings(page, **values: str) -> None:
    for name, value in values.items():
        await page.fill(f"#{name}", value)
        await page.dispatch_event(f"#{name}", "change")


async def _ask(page, question: str) -> None:
    await page.fill("#prompt", question)
    await page.press("#prompt", "Enter")


# Waits are by selector (the page's Content-Security-Policy forbids the eval that
# `wait_for_function` would need).
async def _idle(page) -> None:
    await page.locator("body[data-state=idle]").wait_for()


def _copies(page, stage: str):
    return page.locator(f'.stage[data-stage="{stage}"] tr.copy')


def _aborted_count(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(
        r'^llmbus:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text,
        re.MULTILINE))


def _pipeline(base: str) -> dict:
    response = httpx.get(f"{base}/v1/pipeline", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


async def _wait_for(condition, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)  # the browser's connection keeps being served meanwhile


async def test_no_call_succeeds_until_the_key_is_entered(web_stack, browser, request):
    _, base = web_stack
    page_html = httpx.get(base + "/", timeout=30).text
    assert "smollm2" not in page_html.lower()  # `/` itself reveals nothing
    context = await browser.new_context(viewport={"width": 1280, "height": 860})
    page = await context.new_page()
    page.set_default_timeout(WAIT_MS)
    statuses: list[tuple[str, int]] = []
    page.on("response", lambda r: statuses.append((r.url, r.status)) if "/v1/" in r.url
            else None)
    try:
        await page.goto(base + "/pipeline")
        await page.locator("#key-form").wait_for()  # /v1/pipeline answered 401
        assert await page.locator(".stage").count() == 0
        await page.goto(base + "/")
        await page.locator("#key-form").wait_for()  # /v1/models answered 401
        await _settings(page, temperature="0", max_tokens="24")
        await _ask(page, "What is the capital of France?")
        error = page.locator(".message.assistant.error .body")
        await expect(error).to_contain_text("API key")
        assert statuses and all(status == 401 for _, status in statuses), statuses
        await page.fill("#key-input", API_KEY)
        await page.click("#key-form button")
        await page.click("#new-chat")
        await _ask(page, "What is the capital of France?")
        await _idle(page)
        answer = page.locator("#messages .message.assistant:last-child")
        assert (await answer.get_attribute("class")) == "message assistant"  # not an error
        assert (await answer.locator(".body").inner_text()).strip()
        assert any(status == 200 and "/v1/chat/completions" in url for url, status in statuses)
    finally:
        await screenshot(page, request.node.name)
        await context.close()


async def test_an_answer_streams_token_by_token(web_stack, page):
    _, base = web_stack
    await page.goto(base + "/")
    await page.click("#new-chat")
    await _settings(page, temperature="0", max_tokens="48")
    await page.evaluate(RECORD_PAINTS)
    await _ask(page, "Write a short poem about the sea.")
    await _idle(page)
    final = await page.inner_text("#messages .message.assistant:last-child .body")
    paints = await page.evaluate("window.paints")
    before_end = [p for p in paints if p.strip() != final.strip()]
    assert len(before_end) >= 2, paints  # at least two paints of a partial answer
    stats = await page.inner_text("#messages .message.assistant:last-child .stats")
    assert re.search(r"^48 tokens · [\d.]+ tok/s · TTFT \d+ ms$", stats), stats
    # The conversation is kept in the browser: a reload shows it again.
    await page.reload()
    assert await page.inner_text("#messages .message.assistant:last-child .body") == final


async def test_markdown_keeps_code_as_typed_and_escapes_html(web_stack, page):
    _, base = web_stack
    await page.goto(base + "/")
    code = "def f(x):\n    return  x < 2  # <b>not bold</b>\n\n\tindented"
    html = await page.evaluate(
        "async (text) => (await import('/static/markdown.js')).renderMarkdown(text)",
        f"Some **bold** and `a<b>`:\n\n```python\n{code}\n```\n- one\n- two\n<script>x</script>")
    await page.set_content(f"<div id=out>{html}</div>")
    assert await page.inner_text("#out pre code") == code
    assert await page.get_attribute("#out pre", "data-lang") == "python"
    assert await page.inner_text("#out strong") == "bold"
    assert await page.inner_text("#out p code") == "a<b>"
    assert await page.locator("#out li").count() == 2
    assert await page.locator("#out script").count() == 0
    assert "<script>x</script>" in await page.inner_text("#out")


async def test_a_bad_setting_shows_the_servers_message(web_stack, page):
    _, base = web_stack
    await page.goto(base + "/")
    await page.click("#new-chat")
    await _settings(page, temperature="5")
    await _ask(page, "Hello")
    await page.wait_for_selector(".message.assistant.error")
    shown = await page.inner_text(".message.assistant.error .body")
    expected = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=30, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 5})
    assert expected.status_code == 400
    assert shown == expected.json()["error"]["message"]


async def test_stop_aborts_the_request_on_the_server(web_stack, page):
    _, base = web_stack
    aborted_before = _aborted_count(base)
    await page.goto(base + "/")
    await page.click("#new-chat")
    await _settings(page, temperature="0", max_tokens="2000")
    await _ask(page, "Write a very long story about a dragon who learns to cook, in ten "
                     "chapters.")
    answer = page.locator("#messages .message.assistant:last-child .body")
    await expect(answer).to_have_text(re.compile(r".{20}", re.DOTALL), timeout=WAIT_MS)
    await page.click("#stop")
    await _idle(page)
    stats = await page.inner_text("#messages .message.assistant:last-child .stats")
    assert stats.endswith("stopped"), stats
    # The server's abort path ran: counted as aborted, shown so, and no engine still runs it.
    await _wait_for(lambda: _aborted_count(base) == aborted_before + 1,
                    what="the abort counted")
    [newest] = _pipeline(base)["recent_requests"][:1]
    assert newest["status"] == "aborted", newest
    assert newest["num_output_tokens"] < 2000
    await _wait_for(lambda: all(c["engine"]["num_running"] == 0
                                for stage in _pipeline(base)["stages"]
                                if stage["name"] == "scheduler" for c in stage["copies"]),
                    what="the engines to drop the request")


async def test_the_pipeline_page_shows_the_live_stack(web_stack, page):
    stack, base = web_stack
    await page.goto(base + "/pipeline")
    expected = {"api": 2, "tokenizer": 2, "scheduler": 2, "executor": 2, "detokenizer": 2}
    for stage, count in expected.items():
        await expect(_copies(page, stage)).to_have_count(count, timeout=WAIT_MS)
    # Requests made by the tests before this one, with links to their traces.
    await page.wait_for_selector("#recent tbody tr")
    link = await page.get_attribute("#recent tbody tr a", "href")
    assert re.fullmatch(r"http://127\.0\.0\.1:16686/trace/[0-9a-f]{32}", link), link
    await screenshot(page, "test_the_pipeline_page_before_the_kill")
    [victim] = [c for c in stack.children if c.name == "detokenizer.1"]
    victim.process.send_signal(signal.SIGKILL)
    await expect(_copies(page, "detokenizer")).to_have_count(1, timeout=WAIT_MS)
    await expect(_copies(page, "scheduler")).to_have_count(2)

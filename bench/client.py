"""Streaming OpenAI-compatible requests with per-chunk timing, and server-side tokenization.

Works against llmbus, llama.cpp's llama-server and vLLM alike: only the fields all of them
send are read (`choices[0].text` / `choices[0].delta.content`, and a final `usage` when
`stream_options.include_usage` is honoured).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from llmbus.bench.metrics import RequestResult

TIMEOUT = httpx.Timeout(None, connect=10.0)  # a long generation is not a hang


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_root(base_url: str) -> str:
    """`http://host:port` from `http://host:port/v1` (/tokenize lives outside /v1)."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The answer text one chunk carries: a chat or text completion chunk, a Responses API
    `response.output_text.delta` or a Messages API `text_delta`."""
    kind = chunk.get("type")
    if kind == "response.output_text.delta":
        return chunk["delta"]
    if kind == "content_block_delta":
        return chunk["delta"].get("text") or ""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a Server-Sent Events stream, up to `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _stream_error(chunk: dict[str, Any]) -> Any:
    """The error a chunk reports, in any of the dialects (None when it reports none)."""
    if chunk.get("type") in ("error", "response.failed"):
        return chunk.get("error") or chunk.get("response", {}).get("error") or chunk
    return chunk.get("error")


def _count_usage(result: RequestResult, chunk: dict[str, Any]) -> None:
    kind = chunk.get("type")
    if kind in ("response.completed", "response.incomplete", "message_delta"):
        usage = (chunk.get("response") or chunk).get("usage") or {}
        chunk = {"usage": {"completion_tokens": usage.get("output_tokens"),
                           "prompt_tokens": usage.get("input_tokens")}}
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = usage["completion_tokens"]
        result.usage_counted = True
        if result.prompt_len is None:
            result.prompt_len = usage.get("prompt_tokens")


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], *,
                         headers: dict[str, str], prompt_len: int | None = None,
                         count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """Send one streaming request and time every text chunk; never raises for server errors."""
    result = RequestResult(prompt_len=prompt_len)
    parts: list[str] = []
    start = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for chunk in _sse_chunks(response):
                error = _stream_error(chunk)
                if error:
                    result.error = f"stream error: {json.dumps(error)[:300]}"
                    return result
                _count_usage(result, chunk)
                text = _chunk_text(chunk)
                if text:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if last is None:
        result.ttft = result.latency
    result.output_text = "".join(parts)
    if not result.usage_counted:
        # Re-tokenizing the text is exact for ordinary text; a count of chunks is the last resort.
        result.output_tokens = (count_tokens(result.output_text) if count_tokens
                                else len(parts))
    result.ok = True
    return result


class ServerTokenizer:
    """The server's own /tokenize: llmbus and vLLM take `prompt`, llama-server `content`."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None = None) -> None:
        self.url = server_root(base_url) + "/tokenize"
        self.model = model
        self.client = httpx.Client(timeout=30.0, headers=auth_headers(api_key))
        self.style: str | None = None

    def _bodies(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        openai_style = {"prompt": text, "add_special_tokens": False}
        if self.model:
            openai_style["model"] = self.model
        llama_style = {"content": text, "add_special": False}
        bodies = [("prompt", openai_style), ("content", llama_style)]
        return [b for b in bodies if b[0] == self.style] if self.style else bodies

    def encode(self, text: str) -> list[int]:
        for style, body in self._bodies(text):
            response = self.client.post(self.url, json=body)
            tokens = response.json().get("tokens") if response.status_code == 200 else None
            # llama-server answers an unknown body with no tokens rather than an error
            if isinstance(tokens, list) and (tokens or not text or self.style):
                self.style = style
                # llama-server may answer pieces ({"id", "piece"}) when asked; ids here.
                return [t["id"] if isinstance(t, dict) else t for t in tokens]
        raise RuntimeError(f"{self.url} does not tokenize (tried llmbus/vLLM and llama.cpp "
                           "bodies); use --tokenizer gguf")

    def close(self) -> None:
        self.client.close()

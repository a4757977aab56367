"""One benchmark run against one OpenAI-compatible server: arrivals, concurrency, progress.

Requests arrive as a Poisson process (seeded, so two servers see the same schedule) and at
most `max_concurrency` are in flight; the run's duration is from the first send to the last
answer. One warm-up request first, untimed, so that lazy start-up work is not measured and so
that a server which rejects `stream_options` is found out before the run.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from llmbus.bench.client import TIMEOUT, auth_headers, stream_request
from llmbus.bench.datasets import BenchRequest, dialect_body, request_body
from llmbus.bench.metrics import RequestResult, summarize

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions",
             "responses": "/responses", "messages": "/messages"}


def arrival_delays(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each send: exponential gaps of mean 1/rate; all 0 when rate=inf."""
    if request_rate <= 0:
        raise ValueError("--request-rate must be positive (inf: all at once)")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num_requests)]


class Progress:
    """A plain-text progress bar on stderr, redrawn in place (or every 10% when not a tty)."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.width = total, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.done = self.failed = 0
        self.start = time.perf_counter()
        self._last_decile = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        decile = self.done * 10 // max(self.total, 1)
        if self.tty or decile != self._last_decile or self.done == self.total:
            self._last_decile = decile
            self.draw()

    def render(self) -> str:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        return (f"[{bar}] {self.done}/{self.total} requests, {self.failed} failed, "
                f"{elapsed:.1f} s")

    def draw(self) -> None:
        end = "" if self.tty and self.done < self.total else "\n"
        self.stream.write(("\r" if self.tty else "") + self.render() + end)
        self.stream.flush()


@dataclass
class RunConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    max_concurrency: int | None = None
    request_rate: float = math.inf
    max_tokens: int = 128
    ignore_eos: bool = False
    seed: int = 0
    num_warmups: int = 1
    progress: bool = True
    json_schema: dict | None = None  # every request's output constrained to this schema

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in vars(self).items() if k not in ("api_key", "progress")}
        data["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return data


async def fetch_model_name(base_url: str, api_key: str | None) -> str:
    """The first model the server lists (what `--model` defaults to)."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(base_url.rstrip("/") + "/models",
                                    headers=auth_headers(api_key))
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def run_benchmark(requests: Sequence[BenchRequest], config: RunConfig,
                        count_tokens: Callable[[str], int] | None = None,
                        transport: httpx.AsyncBaseTransport | None = None,
                        ) -> tuple[list[RequestResult], float, bool]:
    """Run every request; returns (results in dataset order, duration in s, usage honoured).

    `transport` replaces the network (tests use `httpx.MockTransport`).
    """
    url = config.base_url.rstrip("/") + ENDPOINTS[config.endpoint]
    headers = auth_headers(config.api_key)
    limit = config.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)

    def body(request: BenchRequest, max_tokens: int | None = None) -> dict[str, Any]:
        chat = request_body(request, chat=config.endpoint != "completions", model=config.model,
                            max_tokens=max_tokens or config.max_tokens,
                            ignore_eos=config.ignore_eos,
                            include_usage=include_usage and config.endpoint in ("chat",
                                                                                "completions"),
                            json_schema=config.json_schema)
        return dialect_body(chat, config.endpoint)

    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits, transport=transport) as client:
        include_usage = True
        for _ in range(config.num_warmups):
            warm = await stream_request(client, url, body(requests[0], 4), headers=headers)
            if not warm.ok and include_usage and "stream_options" in warm.error:
                include_usage = False  # a server without the option: count with the tokenizer
                warm = await stream_request(client, url, body(requests[0], 4), headers=headers)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        semaphore = asyncio.Semaphore(limit)
        progress = Progress(len(requests)) if config.progress else None

        async def one(request: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await stream_request(client, url, body(request, request.max_tokens),
                                              headers=headers, prompt_len=request.prompt_len,
                                              count_tokens=count_tokens)
            if progress:
                progress.update(result.ok)
            return result

        tasks = []
        start = time.perf_counter()
        for request, delay in zip(requests, arrival_delays(len(requests), config.request_rate,
                                                           config.seed), strict=True):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return results, duration, include_usage


def bench_report(requests: Sequence[BenchRequest], config: RunConfig,
                 count_tokens: Callable[[str], int] | None = None,
                 extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark (blocking) and return its report."""
    results, duration, usage = asyncio.run(run_benchmark(requests, config, count_tokens))
    report = summarize(results, duration, {**config.as_dict(), **(extra_config or {})})
    report["config"]["include_usage"] = usage
    return report

"""Shared-prefix workload with and without the prefix cache, on a real `llmbus up` stack.

64 requests share one ~1000-token system text and differ in a ~32-token question; 32 output
tokens each; 16 in flight. Prints time to first token (p50/p90) for each run, their ratio, and
the cache hit rate the engine reports. Target: TTFT p50 at least 3x better with the cache.

    python -m llmbus.bench.prefix_cache [--requests 64] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from tests.stack import MODEL_NAME, engine_stats, start_stack, stop_stack  # noqa: E402

SYSTEM = ("You are a meticulous assistant for a public library. " * 4 + "Rules: "
          + " ".join(f"Rule {i}: answer politely, cite the shelf number {i * 7}, and never "
                     f"invent a book title." for i in range(40)))


async def run_load(base_url: str, num_requests: int, concurrency: int,
                   max_tokens: int) -> list[float]:
    semaphore = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL_NAME, "stream": True, "temperature": 0, "max_tokens": max_tokens,
                "ignore_eos": True, "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Question {i}: which shelf holds books about "
                                                f"topic number {i * 13 % 97}, and why?"}]}
        async with semaphore:
            started = time.perf_counter()
            async with client.stream("POST", f"{base_url}/chat/completions", json=body) as r:
                r.raise_for_status()
                first = True
                async for line in r.aiter_lines():
                    if first and '"content":"' in line and '"content":""' not in line:
                        ttfts.append(time.perf_counter() - started)
                        first = False

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(num_requests)))
    return sorted(ttfts)


def measure(label: str, extra: list[str], args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp), *extra)
        try:
            asyncio.run(run_load(stack.base_url, 2, 1, 4))  # warm-up, then measure fresh
            ttfts = asyncio.run(run_load(stack.base_url, args.requests, args.concurrency,
                                         args.max_tokens))
            stats = asyncio.run(engine_stats(stack.nats_url))
        finally:
            stop_stack(stack)
    p50, p90 = statistics.median(ttfts), ttfts[int(len(ttfts) * 0.9)]
    hit = stats.num_prefix_hit_tokens / max(stats.num_prefix_query_tokens, 1)
    print(f"{label:<22} TTFT p50 {p50 * 1e3:8.1f} ms  p90 {p90 * 1e3:8.1f} ms  "
          f"prefix hit rate {hit:6.1%}  preemptions {stats.num_preemptions}", flush=True)
    return p50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    cached = measure("prefix cache", [], args)
    uncached = measure("--no-prefix-caching", ["--no-prefix-caching"], args)
    print(f"TTFT p50 ratio (no cache / cache): {uncached / cached:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()

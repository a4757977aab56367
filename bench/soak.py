"""Bounded soak: mixed load on a real stack for a while; prints every service's memory at the
start and the end, KV blocks leaked, and errors. Run it for minutes outside CI:

    python -m llmbus.bench.soak --seconds 600 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import httpx

from tests.stack import (  # noqa: E402
    MODEL_NAME,
    RunningStack,
    engine_stats,
    start_stack,
    stop_stack,
)


def service_rss(launcher_pid: int) -> dict[str, int]:
    """RSS in MiB of each child of the launcher, by service name."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != launcher_pid:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            name = argv[argv.index(b"serve") + 1].decode() if b"serve" in argv else "nats"
            rss_kib = next(int(line.split()[1]) for line in (proc / "status").read_text()
                           .splitlines() if line.startswith("VmRSS:"))
            out[name] = out.get(name, 0) + rss_kib // 1024
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return dict(sorted(out.items()))


async def one_request(http: httpx.AsyncClient, base_url: str, rng: random.Random,
                      counts: dict[str, int]) -> None:
    chat = rng.random() < 0.7
    body: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 48),
                  "temperature": rng.choice([0.0, 0.8]), "n": rng.choice([1, 1, 1, 2]),
                  "stream": rng.random() < 0.6}
    if chat:
        topic = rng.randint(0, 50)
        body["messages"] = [{"role": "user", "content": f"Tell me about topic {topic}"}]
    else:
        body["prompt"] = f"Item {rng.randint(0, 999)} in the list is"
    url = f"{base_url}/{'chat/completions' if chat else 'completions'}"
    disconnect = body["stream"] and rng.random() < 0.1
    try:
        if body["stream"]:
            async with http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    counts["errors"] += 1
                    return
                async for line in response.aiter_lines():
                    if disconnect:
                        counts["disconnects"] += 1
                        return  # leaving mid-stream: the request must be aborted
                    if line.startswith('data: {"error"'):
                        counts["errors"] += 1
                        return
        else:
            response = await http.post(url, json=body)
            if response.status_code != 200:
                counts["errors"] += 1
                return
        counts["ok"] += 1
    except httpx.HTTPError:
        counts["errors"] += 1


async def load(base_url: str, seconds: float, concurrency: int,
               headers: dict[str, str] | None = None) -> dict[str, int]:
    counts = {"ok": 0, "errors": 0, "disconnects": 0}
    deadline = time.monotonic() + seconds
    rng = random.Random(0)

    async def worker(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            await one_request(http, base_url, rng, counts)

    async with httpx.AsyncClient(timeout=120, headers=headers) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return counts


def soak(stack: RunningStack, seconds: float, concurrency: int,
         headers: dict[str, str] | None = None) -> tuple[str, int, int]:
    """Load a running stack (its launcher's children measured); returns the report, the KV
    blocks leaked and the errors."""
    before = service_rss(stack.process.pid)
    counts = asyncio.run(load(stack.base_url, seconds, concurrency, headers))
    time.sleep(1.0)
    after = service_rss(stack.process.pid)
    stats = asyncio.run(engine_stats(stack.nats_url))
    leaked = stats.num_total_blocks - stats.num_free_blocks - stats.num_evictable_blocks
    lines = [f"requests: {counts['ok']} ok, {counts['disconnects']} client disconnects"]
    lines += [f"rss {name:<12} {before.get(name, 0):6d} MiB -> {after.get(name, 0):6d} MiB"
              for name in sorted(set(before) | set(after))]
    lines += [f"running {stats.num_running}, waiting {stats.num_waiting}",
              f"leaked blocks: {leaked}", f"errors: {counts['errors']}"]
    return "\n".join(lines), leaked, counts["errors"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp))
        try:
            report, _, _ = soak(stack, args.seconds, args.concurrency)
        finally:
            stop_stack(stack)
    print(report)


if __name__ == "__main__":
    main()

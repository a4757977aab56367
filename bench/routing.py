"""Cache-aware routing vs random routing over two engines: prefix-cache hit rates.

Shared-prefix workload: 8 groups, each a distinct ~600-token system text, 8 questions per
group, 8 output tokens; every request goes through `llmbus up --replicas engine=2`. With
cache-aware routing each group should stay on one engine, so the hit rate approaches what one
engine alone gets; random routing splits groups and computes each prefix on both engines.

    python -m llmbus.bench.routing [--groups 8] [--per-group 8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import httpx
import nats

from llmbus.bus import subjects  # noqa: E402
from llmbus.bus.codec import decode, encode  # noqa: E402
from llmbus.bus.messages import EngineStats, EngineStatsRequest  # noqa: E402
from tests.stack import MODEL_NAME, start_stack, stop_stack  # noqa: E402


def system_text(group: int) -> str:
    return f"Group {group} handbook. " + " ".join(
        f"Clause {group}.{i}: keep records of item {i * (group + 3)} in drawer {i % 9}."
        for i in range(45))


async def run(base_url: str, groups: int, per_group: int) -> None:
    semaphore = asyncio.Semaphore(8)

    async def one(client: httpx.AsyncClient, group: int, i: int) -> None:
        body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "system", "content": system_text(group)},
            {"role": "user", "content": f"Which drawer holds item {i}?"}]}
        async with semaphore:
            (await client.post(f"{base_url}/chat/completions", json=body)).raise_for_status()

    async with httpx.AsyncClient(timeout=600) as client:
        # Interleave groups, as independent users would arrive.
        await asyncio.gather(*(one(client, g, i) for i in range(per_group)
                               for g in range(groups)))


async def stats(nats_url: str) -> list[EngineStats]:
    nc = await nats.connect(nats_url)
    replies: list[EngineStats] = []

    async def collect(msg) -> None:
        replies.append(decode(msg.data, EngineStats))

    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=collect)
    await nc.publish(subjects.ENGINE_STATS, encode(EngineStatsRequest()), reply=inbox)
    await asyncio.sleep(0.5)
    await nc.close()
    return replies


def measure(routing: str, engines: int, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp), "--replicas", f"engine={engines}", "--routing", routing,
                            "--threads", "1")
        try:
            asyncio.run(run(stack.base_url, args.groups, args.per_group))
            engine_stats = asyncio.run(stats(stack.nats_url))
        finally:
            stop_stack(stack)
    hits = sum(s.num_prefix_hit_tokens for s in engine_stats)
    queries = sum(s.num_prefix_query_tokens for s in engine_stats)
    per_engine = ", ".join(f"{s.engine_id}: {s.num_finished} requests" for s in engine_stats)
    print(f"{engines} engine(s), {routing:<11} prefix hit rate {hits / max(queries, 1):6.1%}"
          f"  ({per_engine})", flush=True)
    return hits / max(queries, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    args = parser.parse_args()
    one = measure("cache-aware", 1, args)
    aware = measure("cache-aware", 2, args)
    rand = measure("random", 2, args)
    print(f"hit rate vs one engine: cache-aware {aware / one:.2f}, random {rand / one:.2f}")


if __name__ == "__main__":
    main()

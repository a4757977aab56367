"""What the pipeline page shows (`/v1/pipeline`): every stage's live copies, the engines' load,
and the requests the api copies served lately. Pure: the route gathers, this assembles.

The data is what the stack already has: the heartbeats every copy sends (liveness), the engines'
stats (one scatter-gather), and each api copy's recent requests (gathered with its metrics).
Nothing here is kept per client: any api copy answers any poll.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmbus.bus.messages import EngineStats, Heartbeat, RecentRequest

STAGE_ORDER = ("api", "tokenizer", "scheduler", "executor", "detokenizer")
NUM_RECENT_SHOWN = 20


class RecentRequests:
    """The last `size` requests one api copy admitted, oldest first. Time is an argument."""

    def __init__(self, replica: str, size: int = 50) -> None:
        self.replica = replica
        self.size = size
        self._items: OrderedDict[str, RecentRequest] = OrderedDict()

    def started(self, request_id: str, created: float, num_prompt_tokens: int,
                trace_id: str) -> None:
        self._items[request_id] = RecentRequest(
            request_id=request_id, replica=self.replica, created=created, status="running",
            num_prompt_tokens=num_prompt_tokens, trace_id=trace_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def ended(self, request_id: str, *, status: str, finish_reason: str, num_output_tokens: int,
              ttft_seconds: float | None, seconds: float) -> None:
        item = self._items.get(request_id)
        if item is None:
            return  # pushed out by newer ones meanwhile
        item.status = status
        item.finish_reason = finish_reason
        item.num_output_tokens = num_output_tokens
        item.ttft_seconds = -1.0 if ttft_seconds is None else ttft_seconds
        item.seconds = seconds

    def snapshot(self, now: float) -> list[RecentRequest]:
        """Copies, running ones with their age so far (`now`: unix time)."""
        return [msgspec.structs.replace(r, seconds=max(now - r.created, 0.0))
                if r.status == "running" else msgspec.structs.replace(r)
                for r in self._items.values()]


@dataclass
class TokenRates:
    """Tokens per second of each engine: the growth of its cumulative count between samples
    taken when the page polls, over the last `window` seconds (or since the first sample).
    None until two samples lie `min_span` apart. Time is an argument."""

    window: float = 5.0
    min_span: float = 0.5
    _samples: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def observe(self, engine_id: str, count: int, now: float) -> float | None:
        samples = self._samples.setdefault(engine_id, deque())
        if samples and count < samples[-1][1]:
            samples.clear()  # a new engine process under the same id: its count restarted
        samples.append((now, count))
        # Keep one sample at least `window` old, so the rate spans the whole window.
        while len(samples) > 2 and now - samples[1][0] >= self.window:
            samples.popleft()
        then, before = samples[0]
        if now - then < self.min_span:
            return None
        return (count - before) / (now - then)


def _copy(heartbeat: Heartbeat, age: float) -> dict[str, Any]:
    return {"instance_id": heartbeat.instance_id, "engine_id": heartbeat.engine_id or None,
            "heartbeat_age_seconds": round(age, 3), "num_handled": heartbeat.num_handled,
            "num_reconnects": heartbeat.num_reconnects,
            "shard": heartbeat.shard or None}  # a layer shard of its engine's executor


def _engine(stats: EngineStats | None, heartbeat: Heartbeat,
            tokens_per_second: float | None) -> dict[str, Any]:
    """An engine's load: from its stats when it answered the gather, else its heartbeat."""
    if stats is None:
        total = heartbeat.num_total_blocks
        used = total - heartbeat.num_free_blocks - heartbeat.num_evictable_blocks
        return {"role": heartbeat.role or "mixed", "num_running": heartbeat.num_running,
                "num_waiting": heartbeat.num_waiting, "kv_usage": used / max(total, 1),
                "prefix_hit_rate": None, "tokens_per_second": None, "num_preemptions": None}
    used = stats.num_total_blocks - stats.num_free_blocks - stats.num_evictable_blocks
    return {"role": heartbeat.role or "mixed", "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_usage": used / max(stats.num_total_blocks, 1),
            "prefix_hit_rate": (stats.num_prefix_hit_tokens / stats.num_prefix_query_tokens
                                if stats.num_prefix_query_tokens else None),
            "tokens_per_second": tokens_per_second,
            "num_preemptions": stats.num_preemptions}


def _recent(request: RecentRequest, trace_url: str | None) -> dict[str, Any]:
    return {"id": request.request_id, "replica": request.replica, "created": request.created,
            "status": request.status, "finish_reason": request.finish_reason or None,
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_output_tokens": request.num_output_tokens,
            "ttft_seconds": None if request.ttft_seconds < 0 else request.ttft_seconds,
            "seconds": request.seconds, "trace_id": request.trace_id or None,
            "trace_url": trace_url.format(trace_id=request.trace_id)
            if trace_url and request.trace_id else None}


def pipeline_view(*, model: str | None, replica: str,
                  copies: dict[str, list[tuple[Heartbeat, float]]], stats: list[EngineStats],
                  rates: dict[str, float | None], recent: list[RecentRequest],
                  trace_url: str | None) -> dict[str, Any]:
    """The `/v1/pipeline` body. `copies`: each stage's live copies with the seconds since
    each one's last heartbeat; `stats` and `rates` by engine; `recent` from every api copy."""
    stats_of = {s.engine_id: s for s in stats}
    adapters_of: dict[str, set[str]] = {}  # each engine's resident LoRA adapters
    for heartbeat, _ in copies.get("executor", []):
        adapters_of.setdefault(heartbeat.engine_id, set()).update(heartbeat.adapters)
    stages = []
    for name in STAGE_ORDER:
        listed = []
        for heartbeat, age in sorted(copies.get(name, []),
                                     key=lambda c: (c[0].engine_id, c[0].instance_id)):
            item = _copy(heartbeat, age)
            if name == "scheduler":
                item["engine"] = _engine(stats_of.get(heartbeat.engine_id), heartbeat,
                                         rates.get(heartbeat.engine_id))
                item["engine"]["adapters"] = sorted(adapters_of.get(heartbeat.engine_id, ()))
            elif name == "executor":
                item["adapters"] = sorted(heartbeat.adapters)
            listed.append(item)
        stages.append({"name": name, "copies": listed})
    newest = sorted(recent, key=lambda r: r.created, reverse=True)[:NUM_RECENT_SHOWN]
    return {"object": "pipeline", "model": model, "replica": replica, "stages": stages,
            "recent_requests": [_recent(r, trace_url) for r in newest],
            "tracing": trace_url is not None}

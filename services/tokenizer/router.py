"""Cache-aware routing of requests across engines (pure: no bus, time is an argument).

Each engine announces the blocks it caches (CacheEvent) and its load (Heartbeat). The router
keeps, per engine, the set of cached block hashes, and sends a prompt to the engine holding its
longest cached prefix, unless that engine is much busier than the least loaded one; a prompt
nobody caches goes to the least loaded engine. A request for a LoRA adapter hashes its blocks
under the adapter (bus/block_hash.py), and prefers, among the least loaded, an engine that holds
the adapter already (its heartbeat's `adapters`): another would first fetch it. After routing,
the prompt's blocks are counted as cached on the chosen engine right away (it will cache them
within a step), so a burst of requests sharing a prefix sticks together before the first events
arrive.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from llmbus.bus.block_hash import block_hashes
from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import CacheEvent, Heartbeat

# Cached prefix worth following, as a fraction of the prompt.
MIN_MATCH_FRACTION = 0.25
# How many more requests (running + waiting) the cache-holding engine may have than the
# least loaded one before load wins over cache.
BALANCE_SLACK = 8


@dataclass
class EngineView:
    engine_id: str
    cached: set[int] = field(default_factory=set)
    # Requests sent since its last heartbeat: a burst arrives faster than heartbeats.
    num_routed: int = 0


@dataclass
class Router:
    liveness: Liveness = field(default_factory=Liveness)
    views: dict[str, EngineView] = field(default_factory=dict)  # by scheduler instance id
    policy: str = "cache-aware"  # or "random": the baseline the routing benchmark compares
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def on_heartbeat(self, heartbeat: Heartbeat, now: float) -> None:
        self.liveness.seen(heartbeat, now)
        view = self.views.setdefault(heartbeat.instance_id, EngineView(heartbeat.engine_id))
        view.num_routed = 0  # the heartbeat's own counts include them now

    def on_cache_event(self, instance_id: str, event: CacheEvent) -> None:
        view = self.views.setdefault(instance_id, EngineView(event.engine_id))
        if event.cleared:
            view.cached.clear()
        view.cached.update(event.stored)
        view.cached.difference_update(event.removed)

    def forget_dead(self, now: float) -> list[Heartbeat]:
        dead = self.liveness.reap(now)
        for heartbeat in dead:
            self.views.pop(heartbeat.instance_id, None)
        return dead

    def choose(self, prompt_token_ids: list[int], now: float,
               exclude: frozenset[str] = frozenset(), adapter: str = "") -> Heartbeat | None:
        """The engine (its latest heartbeat) for this prompt under LoRA `adapter` ("": the
        base model); None if no engine is alive."""
        engines = [h for h in self.liveness.alive(now)  # prefill engines take no requests
                   if h.instance_id not in exclude and h.role != "prefill"]
        if not engines:
            return None
        if self.policy == "random":
            return self.rng.choice(engines)

        def load(h: Heartbeat) -> int:
            view = self.views.get(h.instance_id)
            return h.num_running + h.num_waiting + (view.num_routed if view else 0)

        least = min(engines, key=lambda h: (load(h), -h.num_free_blocks, h.instance_id))
        holding = [h for h in engines if adapter in h.adapters]
        if adapter and holding:
            nearest = min(holding, key=lambda h: (load(h), -h.num_free_blocks, h.instance_id))
            least = nearest if load(nearest) <= load(least) + BALANCE_SLACK else least
        block_size = engines[0].block_size or 16
        hashes = block_hashes(prompt_token_ids, block_size, adapter=adapter)
        best, best_match = least, 0
        for h in engines:
            cached = self.views.get(h.instance_id, EngineView(h.engine_id)).cached
            match = next((i for i, x in enumerate(hashes) if x not in cached), len(hashes))
            if match > best_match or (match == best_match and match and load(h) < load(best)):
                best, best_match = h, match
        enough = best_match * block_size >= MIN_MATCH_FRACTION * len(prompt_token_ids)
        chosen = best if enough and load(best) <= load(least) + BALANCE_SLACK else least
        view = self.views.setdefault(chosen.instance_id, EngineView(chosen.engine_id))
        view.cached.update(hashes)
        view.num_routed += 1
        return chosen

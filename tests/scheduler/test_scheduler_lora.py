"""LoRA adapters in the scheduler and the router: the prefix cache keyed by adapter (no block
shared between adapters or with the base), running requests kept within the executor's
adapter slots, and routing that prefers an engine holding the adapter."""

from __future__ import annotations

import dataclasses

from llmbus.bus.block_hash import block_hashes
from llmbus.bus.messages import Heartbeat
from llmbus.services.scheduler.block_allocator import BlockAllocator
from llmbus.services.scheduler.prefix_tree import PrefixTree
from llmbus.services.scheduler.scheduler import Scheduler
from llmbus.services.tokenizer.router import BALANCE_SLACK, Router
from tests.scheduler.sim import add, make, run_step

BLOCK = 4


def _serving_adapters(s: Scheduler, max_adapters: int) -> Scheduler:
    s.swap(dataclasses.replace(s.config, max_adapters=max_adapters))
    return s


def test_the_cache_keeps_each_adapters_blocks_apart():
    tree = PrefixTree(BlockAllocator(16), BLOCK)
    prompt = list(range(3 * BLOCK))
    base, tuned = tree.allocator.allocate(3), tree.allocator.allocate(3)
    tree.insert(prompt, base)
    tree.insert(prompt, tuned, adapter="tuned")
    assert tree.match(prompt, 3) == base
    assert tree.match(prompt, 3, adapter="tuned") == tuned
    assert tree.match(prompt, 3, adapter="other") == []
    stored, _ = tree.take_events()  # what routers hear: the hashes of each adapter's chain
    assert stored == block_hashes(prompt, BLOCK) + block_hashes(prompt, BLOCK, adapter="tuned")
    assert not set(block_hashes(prompt, BLOCK)) & set(block_hashes(prompt, BLOCK,
                                                                   adapter="tuned"))
    tree.release(base + tuned)
    assert tree.num_evictable() == 6
    tree.check_integrity()
    assert tree.evict(6) == 6 and tree.match(prompt, 3, adapter="tuned") == []


def test_a_prompt_cached_by_the_base_is_computed_again_under_an_adapter():
    s = _serving_adapters(make(num_blocks=12, prefix_caching=True), 2)
    add(s, "base", num_prompt=10, max_tokens=1)
    run_step(s)
    add(s, "tuned", num_prompt=10, max_tokens=1, adapter="tuned")
    plan, _ = run_step(s)
    [item] = plan.scheduled
    assert (item.start, item.num_tokens) == (0, 10)  # nothing reused across adapters
    add(s, "tuned again", num_prompt=10, max_tokens=1, adapter="tuned")
    plan, _ = run_step(s)
    assert (plan.scheduled[0].start, plan.scheduled[0].num_tokens) == (8, 2)
    s.check_invariants()


def test_running_requests_stay_within_the_executors_adapter_slots():
    s = _serving_adapters(make(num_blocks=40, max_num_seqs=8), 2)
    adapter_of = {add(s, f"r{i}", num_prompt=3, max_tokens=3, adapter=adapter).sequence_id:
                  adapter for i, adapter in enumerate(["a", "b", "c", "", "a"])}
    plan, _ = run_step(s)
    running = [adapter_of[item.sequence_id] for item in plan.scheduled]
    assert running == ["a", "b", "", "a"]  # "c" waits for a slot; the base and "a" go by it
    for _ in range(6):
        plan, _ = run_step(s)
        assert len({adapter_of[i.sequence_id] for i in plan.scheduled} - {""}) <= 2
    assert not s.has_work  # "c" ran once "a" and "b" finished


def _beat(instance: str, running: int, adapters: list[str]) -> Heartbeat:
    return Heartbeat(service="scheduler", instance_id=instance, engine_id=instance,
                     num_running=running, num_free_blocks=10, block_size=BLOCK,
                     adapters=adapters)


def test_routing_prefers_an_engine_holding_the_adapter_unless_it_is_much_busier():
    router = Router()
    router.on_heartbeat(_beat("e0", 0, []), now=0.0)
    router.on_heartbeat(_beat("e1", 3, ["tuned"]), now=0.0)
    prompt = list(range(5))  # shorter than a block: no cache to follow
    assert router.choose(prompt, 0.0).engine_id == "e0"
    assert router.choose(prompt, 0.0, adapter="tuned").engine_id == "e1"
    router.on_heartbeat(_beat("e1", 3 + BALANCE_SLACK + 1, ["tuned"]), now=0.0)
    assert router.choose(prompt, 0.0, adapter="tuned").engine_id == "e0"

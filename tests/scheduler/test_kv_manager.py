"""The KV manager's predicate/action pairs: asking never changes anything, acting does exactly
what was asked (exact block ids)."""

from __future__ import annotations

from llmbus.services.scheduler.kv_manager import KVManager

SIZE = 2


def _cached(kv: KVManager, first_token: int, num_blocks: int) -> list[int]:
    """A request's prompt of `num_blocks` full blocks, computed, cached, then let go."""
    blocks = kv.reserve(num_blocks)
    kv.cache(list(range(first_token, first_token + num_blocks * SIZE)), blocks)
    kv.release(blocks)
    return blocks


def test_a_refused_reservation_evicts_nothing():
    kv = KVManager(num_blocks=7, block_size=SIZE, prefix_caching=True)  # blocks 1..6
    assert _cached(kv, 100, 2) == [1, 2]
    held = kv.reserve(3)  # [3, 4, 5]: one free block left, two evictable
    assert held == [3, 4, 5] and kv.num_free == 1 and kv.num_evictable() == 2
    assert not kv.can_reserve(4)
    assert kv.num_cached == 2 and kv.match(list(range(100, 104)), 2) == [1, 2]  # still there
    kv.release([1, 2])  # the match's hold
    assert kv.can_reserve(3)
    assert kv.reserve(3) == [6, 2, 1]  # the free one, then the cached ones, leaf first
    assert kv.num_cached == 0 and kv.num_free == 0
    kv.check([held, [6, 2, 1]])


def test_match_holds_and_shared_blocks_are_known():
    kv = KVManager(num_blocks=5, block_size=SIZE, prefix_caching=True)
    _cached(kv, 0, 2)
    blocks = kv.match([0, 1, 2, 3, 4], max_blocks=2)
    assert blocks == [1, 2]
    assert kv.is_shared(1)  # the cache and this request
    assert kv.num_evictable() == 0 and not kv.can_reserve(3)  # 2 free, none evictable
    kv.lock(blocks)  # a forked completion holds them too
    kv.release(blocks)
    kv.release(blocks)
    assert kv.num_evictable() == 2
    kv.check([])


def test_without_prefix_caching_nothing_is_cached():
    kv = KVManager(num_blocks=4, block_size=SIZE, prefix_caching=False)
    blocks = kv.reserve(2)
    kv.cache([0, 1, 2, 3], blocks)
    assert kv.match([0, 1, 2, 3], 2) == [] and kv.num_cached == 0
    kv.release(blocks)
    assert kv.num_free == 3 and kv.take_events() == ([], [])
    kv.check([])


def test_can_reserve_does_not_walk_the_tree(monkeypatch):
    kv = KVManager(num_blocks=5, block_size=SIZE, prefix_caching=True)
    for first in (0, 10, 20, 30):  # four one-block prompts: four evictable leaves
        _cached(kv, first, 1)
    assert kv.num_free == 0

    def walked() -> int:
        raise AssertionError("the whole tree was walked")

    monkeypatch.setattr(kv.tree, "_walk_evictable", walked)
    assert kv.can_reserve(4) and not kv.can_reserve(5)
    held = kv.match([10, 11], 1)
    assert held == [2] and kv.can_reserve(3) and not kv.can_reserve(4)
    monkeypatch.undo()
    kv.check([held])

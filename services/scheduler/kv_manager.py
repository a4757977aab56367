"""The engine's KV blocks: the free ones, and cached prompt prefixes a request may reuse.

The scheduler asks before it acts: `can_reserve(n)` says whether n blocks can be had (free
ones, plus cached ones no request holds, which are evicted least recently used first), and
only then does `reserve(n)` evict and allocate. `match` returns a cached prefix's blocks held
for the caller (`lock`); `release` lets blocks go (cached ones stay cached until evicted).
Reference counts live in the allocator; the prefix tree holds one reference per cached block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmbus.services.scheduler.block_allocator import BlockAllocator
from llmbus.services.scheduler.prefix_tree import PrefixTree


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tree = PrefixTree(self.allocator, block_size) if prefix_caching else None

    # ------------------------------------------------------------------ accounting

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_usable(self) -> int:
        return self.allocator.num_usable

    @property
    def num_cached(self) -> int:
        return self.tree.num_cached_blocks if self.tree is not None else 0

    def num_evictable(self) -> int:
        """Cached blocks eviction could free now (kept as they change: O(1))."""
        return self.tree.num_evictable() if self.tree is not None else 0

    # ------------------------------------------------------------------ blocks

    def can_reserve(self, num: int) -> bool:
        if num <= self.num_free:
            return True
        return self.tree is not None and self.tree.can_evict(num - self.num_free)

    def reserve(self, num: int) -> list[int]:
        """`num` blocks (ref count 1 each), evicting cached ones if the free ones fall short;
        the caller asked `can_reserve(num)`."""
        if num <= 0:
            return []
        if num > self.num_free and self.tree is not None:
            self.tree.evict(num - self.num_free)
        return self.allocator.allocate(num)

    def lock(self, block_ids: Iterable[int]) -> None:
        """Another owner (a forked completion, a prefix match) holds these blocks too."""
        if self.tree is not None:
            self.tree.hold(block_ids)
        else:
            for block_id in block_ids:
                self.allocator.incref(block_id)

    def release(self, block_ids: Sequence[int]) -> None:
        """One owner lets these blocks go; cached ones become evictable once nobody holds
        them."""
        if self.tree is not None:
            self.tree.release(block_ids)
        else:
            self.allocator.free(list(block_ids))

    def is_shared(self, block_id: int) -> bool:
        """Held by more than one owner: a writer must copy it first (copy-on-write)."""
        return self.allocator.ref_counts[block_id] > 1

    # ------------------------------------------------------------------ prefix cache

    def match(self, token_ids: Sequence[int], max_blocks: int, adapter: str = "") -> list[int]:
        """The blocks of the longest cached prefix of `token_ids` under LoRA `adapter` (at
        most `max_blocks`), locked for the caller."""
        if self.tree is None:
            return []
        block_ids = self.tree.match(token_ids, max_blocks, adapter)
        self.lock(block_ids)
        return block_ids

    def cache(self, token_ids: Sequence[int], block_ids: Sequence[int],
              adapter: str = "") -> None:
        """Offer full blocks holding `token_ids` (a prefix from position 0), computed under
        `adapter`, to the cache."""
        if self.tree is not None:
            self.tree.insert(token_ids, block_ids, adapter)

    def clear_cache(self) -> None:
        """Evict every cached block nobody holds (after a failed step: its blocks may never
        have been written)."""
        if self.tree is not None:
            self.tree.evict(self.tree.num_cached_blocks)

    def take_events(self) -> tuple[list[int], list[int]]:
        """Block hashes stored and evicted since the last call, for cache-aware routing."""
        return self.tree.take_events() if self.tree is not None else ([], [])

    # ------------------------------------------------------------------ checks

    def check(self, held: Iterable[Sequence[int]]) -> None:
        """Reference counts equal the owners (`held`: every request's blocks, plus the
        tree's); no block is lost. For tests."""
        expected = [0] * self.allocator.num_blocks
        for block_ids in held:
            assert len(set(block_ids)) == len(block_ids), "a block listed twice by one owner"
            for block_id in block_ids:
                expected[block_id] += 1
        if self.tree is not None:
            self.tree.check_integrity()
            for block_id in self.tree.nodes_by_block:
                expected[block_id] += 1
        assert expected == self.allocator.ref_counts, "reference counts do not match owners"
        num_free = sum(1 for count in expected[1:] if count == 0)
        assert num_free == self.allocator.num_free, "a free block is lost or listed twice"

"""Radix tree over full KV blocks: finished work stays cached and new requests reuse it.

Each node is one full block of `block_size` token ids, keyed under its parent by those ids, so a
path from a root spells a token prefix. There is a root per LoRA adapter (the base model's is
""): the same tokens under another adapter have another KV, so no block is shared across them.
The tree holds one reference on each cached block (`BlockAllocator.incref`); requests using the
block hold more. A block whose only reference is the tree's, at a leaf, is *evictable*: when the
allocator runs dry, evictable leaves go least recently used first, and a parent whose last child
went becomes a leaf in turn.

Every holder of a cached block also holds the blocks before it (a request's block table is a
path from the root), so a block nobody but the tree holds has no held block below it: all such
blocks can go, leaves first. The tree keeps their number as it changes, so the scheduler's "can
eviction free n blocks?" costs O(1) however large the cache grows.

Contract: `match` only reads; callers must `lock` (incref) the matched blocks before anything
can evict, i.e. before the next allocation.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmbus.bus.block_hash import adapter_hash, chain_hash
from llmbus.services.scheduler.block_allocator import BlockAllocator


@dataclass(eq=False)
class Node:
    block_id: int
    key: tuple[int, ...]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_access: int = 0
    hash: int = 0  # chained hash of the prefix up to this block (bus/block_hash.py)


class PrefixTree:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.roots: dict[str, Node] = {}  # by adapter ("": the base model)
        self.nodes_by_block: dict[int, Node] = {}
        self._clock = itertools.count(1)
        # (last_access, tiebreak, node) candidates; validated lazily when popped.
        self._lru: list[tuple[int, int, Node]] = []
        self._tiebreak = itertools.count()
        # Hashes stored and evicted since the last take_events(), for cache-aware routing.
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._num_unheld = 0  # cached blocks only the tree holds: what eviction can free

    def take_events(self) -> tuple[list[int], list[int]]:
        events = self._stored, self._removed
        self._stored, self._removed = [], []
        return events

    @property
    def num_cached_blocks(self) -> int:
        return len(self.nodes_by_block)

    def _root(self, adapter: str) -> Node:
        root = self.roots.get(adapter)
        if root is None:
            root = self.roots[adapter] = Node(block_id=0, key=(), parent=None,
                                              hash=adapter_hash(adapter))
        return root

    def match(self, token_ids: Sequence[int], max_blocks: int, adapter: str = "") -> list[int]:
        """Block ids of the longest cached prefix of `token_ids` under `adapter`, at most
        `max_blocks` long."""
        node, block_ids, size = self._root(adapter), [], self.block_size
        now = next(self._clock)
        for i in range(min(max_blocks, len(token_ids) // size)):
            child = node.children.get(tuple(token_ids[i * size:(i + 1) * size]))
            if child is None:
                break
            child.last_access = now
            block_ids.append(child.block_id)
            node = child
        return block_ids

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int],
               adapter: str = "") -> None:
        """Cache the full blocks `block_ids` holding `token_ids` (a prefix from position 0)
        computed under `adapter`.

        Blocks already cached under the same tokens (another request computed them first)
        are left alone; the caller's copy stays private to it, and so do the caller's blocks
        after it: cached under the other copy, they would be held by a request that does not
        hold their parent.
        """
        node, size = self._root(adapter), self.block_size
        now = next(self._clock)
        for i, block_id in enumerate(block_ids):
            key = tuple(token_ids[i * size:(i + 1) * size])
            assert len(key) == size, "only full blocks are cached"
            child = node.children.get(key)
            if child is None:
                if block_id in self.nodes_by_block:  # already cached under another prefix
                    return
                child = Node(block_id=block_id, key=key, parent=node,
                             hash=chain_hash(node.hash, key))
                node.children[key] = child
                self._stored.append(child.hash)
                self.nodes_by_block[block_id] = child
                self.allocator.incref(block_id)
                self._num_unheld += self.allocator.ref_counts[block_id] == 1
                self._push_if_evictable(node)  # no longer a leaf: validated lazily
            child.last_access = now
            node = child
            if child.block_id != block_id:
                break
        self._push_if_evictable(node)

    def hold(self, block_ids: Iterable[int]) -> None:
        """Another owner holds these blocks (cached or not) from now on."""
        for block_id in block_ids:
            if block_id in self.nodes_by_block and self.allocator.ref_counts[block_id] == 1:
                self._num_unheld -= 1
            self.allocator.incref(block_id)

    def release(self, block_ids: Sequence[int]) -> None:
        """A request let go of these blocks: free them, and note cached ones as evictable."""
        self.allocator.free(block_ids)
        for block_id in block_ids:
            node = self.nodes_by_block.get(block_id)
            if node is not None:
                self._num_unheld += self.allocator.ref_counts[block_id] == 1
                self._push_if_evictable(node)

    def _evictable(self, node: Node) -> bool:
        return (node.parent is not None and not node.children
                and self.nodes_by_block.get(node.block_id) is node
                and self.allocator.ref_counts[node.block_id] == 1)

    def _push_if_evictable(self, node: Node) -> None:
        if self._evictable(node):
            heapq.heappush(self._lru, (node.last_access, next(self._tiebreak), node))

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` cached blocks, least recently used leaves first."""
        num_evicted = 0
        while num_evicted < num_blocks and self._lru:
            last_access, _, node = heapq.heappop(self._lru)
            if not self._evictable(node) or node.last_access != last_access:
                if self._evictable(node):  # touched since it was pushed: requeue
                    self._push_if_evictable(node)
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            del self.nodes_by_block[node.block_id]
            self._removed.append(node.hash)
            self.allocator.free([node.block_id])
            self._num_unheld -= 1
            num_evicted += 1
            self._push_if_evictable(parent)
        return num_evicted

    def can_evict(self, num_blocks: int) -> bool:
        """Whether eviction could free `num_blocks` now."""
        return self._num_unheld >= num_blocks

    def num_evictable(self) -> int:
        """Blocks that eviction could free now."""
        return self._num_unheld

    def _walk_evictable(self) -> int:
        """num_evictable from scratch, for checks: every node whose block only the tree holds
        and whose whole subtree is free too. Iterative, children before parents: a cached
        prompt of n blocks is a chain n deep, deeper than Python's recursion allows."""
        order, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        free: dict[int, bool] = {}  # id(node) -> it and everything below it are free
        total = 0
        for node in reversed(order):
            free[id(node)] = (all(free[id(child)] for child in node.children.values())
                              and self.allocator.ref_counts[node.block_id] == 1)
            total += free[id(node)] and node.parent is not None
        return total

    def check_integrity(self) -> None:
        """Walk the tree: every node is indexed, keyed by its tokens, and holds a reference."""
        seen = 0
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key and len(key) == self.block_size
                assert self.nodes_by_block[child.block_id] is child
                assert self.allocator.ref_counts[child.block_id] >= 1
                seen += 1
                stack.append(child)
        assert seen == len(self.nodes_by_block)
        assert self._num_unheld == self._walk_evictable(), "a holder skipped a cached ancestor"

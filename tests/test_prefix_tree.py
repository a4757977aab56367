"""PrefixTree.num_evictable (the engine's evictable-block gauge on /metrics)."""

from __future__ import annotations

from services.scheduler.block_allocator import BlockAllocator
from services.scheduler.prefix_tree import PrefixTree

BLOCK = 4


def _cached_chain(num_blocks: int) -> tuple[PrefixTree, BlockAllocator, list[int]]:
    """One request's prompt of `num_blocks` full blocks, cached and then released."""
    allocator = BlockAllocator(num_blocks + 1)
    tree = PrefixTree(allocator, BLOCK)
    blocks = allocator.allocate(num_blocks)
    tree.insert(list(range(num_blocks * BLOCK)), blocks)
    tree.release(blocks)
    return tree, allocator, blocks


def test_a_chain_deeper_than_the_recursion_limit_is_counted():
    # 1,100 blocks raised RecursionError when this walked the tree recursively
    tree, _, _ = _cached_chain(3000)
    assert tree.num_evictable() == 3000


def test_a_block_in_use_keeps_itself_and_its_ancestors():
    tree, allocator, blocks = _cached_chain(10)
    allocator.incref(blocks[4])  # a running request holds the fifth block
    assert tree.num_evictable() == 5  # blocks 6..10 could go; 1..5 cannot
    allocator.free([blocks[4]])
    assert tree.num_evictable() == 10
    assert tree.evict(10) == 10 and tree.num_evictable() == 0

"""PrefixTree.num_evictable: the engine's evictable-block gauge on /metrics, and what the
scheduler asks before it evicts (kept as blocks change hands, checked against a walk)."""

from __future__ import annotations

from llmbus.services.scheduler.block_allocator import BlockAllocator
from llmbus.services.scheduler.prefix_tree import PrefixTree

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
    tree.hold(blocks[:5])  # a running request matched the first five blocks
    assert tree.num_evictable() == 5 and not tree.can_evict(6)  # 6..10 could go; 1..5 not
    tree.check_integrity()
    tree.release(blocks[:5])
    assert tree.num_evictable() == 10 and tree.can_evict(10)
    assert tree.evict(4) == 4 and tree.num_evictable() == 6  # the deepest four went
    tree.check_integrity()
    assert tree.evict(10) == 6 and tree.num_evictable() == 0


def test_the_kept_count_catches_a_holder_that_skips_an_ancestor():
    tree, allocator, blocks = _cached_chain(3)
    allocator.incref(blocks[2])  # behind the tree's back, and without blocks 1 and 2
    try:
        tree.check_integrity()
    except AssertionError as exc:
        assert "ancestor" in str(exc)
    else:
        raise AssertionError("the check missed a count gone stale")


def test_a_request_that_computed_cached_tokens_again_keeps_what_follows_private():
    allocator = BlockAllocator(8)
    tree = PrefixTree(allocator, BLOCK)
    first, second = allocator.allocate(1), allocator.allocate(2)
    tree.insert(list(range(BLOCK)), first)  # the first request cached the prompt
    tree.release(first)
    # the second computed the same prompt in its own block (it was planned before the first's
    # result came back), then a block of its own answer
    tree.insert(list(range(BLOCK)) + [7] * BLOCK, second)
    assert list(tree.nodes_by_block) == first  # its answer is not cached under the other copy
    tree.check_integrity()
    assert tree.num_evictable() == 1
    tree.release(second)
    assert tree.evict(8) == 1 and allocator.num_free == 7

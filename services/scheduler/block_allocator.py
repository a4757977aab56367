"""Logical KV blocks: a free list with reference counts. Block 0 is the null block.

The executor owns the physical tensors; this only decides which block ids a request may write.
Block 0 is never handed out, so padded block tables can point at it harmlessly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, num: int) -> list[int]:
        """Take `num` free blocks (ref count 1 each); the caller checked `num_free`."""
        if num > len(self._free_ids):
            raise RuntimeError(f"out of KV blocks: want {num}, have {len(self._free_ids)}")
        block_ids = [self._free_ids.popleft() for _ in range(num)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"incref of free block {block_id}"
        self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            assert count > 0, f"double free of block {block_id}"
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free_ids.append(block_id)

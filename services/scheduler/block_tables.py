"""Each request's block table over the engine's KV blocks: the prefix it reuses, the blocks it
reserves (a shared one copied first), the full blocks it offers the prefix cache and the blocks
it gives back. Which blocks are free, cached or evictable is the KV manager's (kv_manager.py);
what a request's blocks hold is here.

- `block_table`: the request's blocks, block_size tokens each, the last one maybe partial;
- `num_cached_blocks`: its leading full blocks already offered to the prefix cache;
- `sent.num_blocks`: its leading blocks the executor has (a plan carries only the new ones).

Pure: no bus, no clock.
"""

from __future__ import annotations

from llmbus.bus.messages import BlockCopy
from llmbus.services.scheduler.kv_manager import KVManager
from llmbus.services.scheduler.request import Request


class BlockTables:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.copies: list[BlockCopy] = []  # copy-on-write, for the executor before the next step

    def match_prefix(self, request: Request) -> int:
        """Reuse cached full blocks of the request's tokens; returns the number of blocks.

        At least one token is left to compute: the step needs its logits (or, for a parent,
        its KV must be written by a step before the fork).
        """
        if request.num_computed_tokens or request.embeds:  # pooling reads every prompt row
            return 0
        block_ids = self.kv.match(request.token_ids(),
                                  (request.target_tokens - 1) // self.block_size,
                                  request.params.adapter)
        request.block_table = block_ids
        request.num_cached_blocks = len(block_ids)
        request.num_computed_tokens = len(block_ids) * self.block_size
        return len(block_ids)

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full blocks whose tokens are known to the prefix cache."""
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.block_size
        if num_full > request.num_cached_blocks:
            self.kv.cache(request.token_ids()[:num_full * self.block_size],
                          request.block_table[:num_full], request.params.adapter)
            request.num_cached_blocks = num_full

    def reserve(self, request: Request, num_new: int) -> bool:
        """Make the block table hold the tokens up to num_computed + num_new, if blocks allow
        (False: nothing changed).

        The first block written may be shared (forked completions): it is copied first.
        """
        size = self.block_size
        table = request.block_table
        first = request.num_computed_tokens // size
        shared = first < len(table) and self.kv.is_shared(table[first])
        num_needed = max(-(-(request.num_computed_tokens + num_new) // size) - len(table)
                         + shared, shared)
        if not self.kv.can_reserve(num_needed):
            return False
        blocks = self.kv.reserve(num_needed)
        if shared:
            assert request.sent.num_blocks <= first, "copy-on-write of a block already sent"
            copy = blocks.pop(0)
            self.copies.append(BlockCopy(src=table[first], dst=copy))
            self.kv.release([table[first]])
            table[first] = copy
        table.extend(blocks)
        return True

    def share(self, parent: Request, child: Request) -> None:
        """A forked completion starts with its parent's blocks, held for it too."""
        child.block_table = list(parent.block_table)
        child.num_cached_blocks = parent.num_cached_blocks
        self.kv.lock(child.block_table)

    def release(self, request: Request) -> None:
        """Give the request's blocks back (cached ones stay cached): it computes from 0."""
        self.kv.release(request.block_table)
        request.block_table = []
        request.num_cached_blocks = 0
        request.sent.num_blocks = 0
        request.num_computed_tokens = 0

    def take_copies(self) -> list[BlockCopy]:
        copies, self.copies = self.copies, []
        return copies

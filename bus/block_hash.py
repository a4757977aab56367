"""Chained hashes of full KV blocks: the shared name of a cached prefix.

Block i's hash covers every token up to the end of block i (it chains the previous hash), so
equal hashes mean equal prefixes. The chain starts from the LoRA adapter's hash (0 for the base
model): the same tokens under another adapter are another KV, and another name. Engines
announce hashes of what they cache; the router hashes a new prompt the same way and asks who
holds its longest prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_hash(parent: int, block_token_ids: Sequence[int]) -> int:
    """The hash of a block given its parent's hash (0 for the first block); a 63-bit int."""
    data = parent.to_bytes(8, "little") + array("q", block_token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def adapter_hash(adapter: str) -> int:
    """Where a chain starts: 0 for the base model, a 63-bit hash of an adapter's name."""
    if not adapter:
        return 0
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(),
                          "little") >> 1


def block_hashes(token_ids: Sequence[int], block_size: int,
                 max_blocks: int | None = None, adapter: str = "") -> list[int]:
    """Hashes of the full blocks of `token_ids` (at most `max_blocks`) under `adapter`."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes, parent = [], adapter_hash(adapter)
    for i in range(num_blocks):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes

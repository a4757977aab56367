"""Disaggregated prefill, the prefill executor's forward-thread part: copy a sequence's prompt
blocks out of the KV cache as its steps fill them, cut into chunks for the bus.

A prefill for another engine arrives with a `KvDestination` (which of the decode engine's
blocks take which prompt blocks). After each step's forward, and before a later step can reuse
those blocks, `KvGathering.gather_filled` copies out the prompt blocks that step filled (the
last, partial one with the prompt's end) into its outbox; the service takes the outbox after
the step and sends it (kv_transfer.py's `KvSender`). A sequence forgotten before its prompt is
all gathered (aborted) leaves its transfer id behind, so the service stops sending it.
`layout_of` is the cache's geometry, which both ends of a transfer must share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmbus.bus.messages import (
    KvChunk,
    KvDestination,
    KvLayout,
    NewRequestData,
    ScheduledRequest,
)
from llmbus.services.executor.kv_cache import KVCache

CHUNK_OVERHEAD_BYTES = 16 << 10  # the chunk's fields and headers, besides K and V


def layout_of(cache: KVCache) -> KvLayout:
    """The cache's geometry, which a transfer's sender and receiver must share."""
    num_layers, _, block_size, num_kv_heads, head_dim = cache.k.shape
    return KvLayout(dtype=str(cache.k.dtype).removeprefix("torch."), block_size=block_size,
                    num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)


@dataclass
class Outgoing:
    """Some gathered blocks of one transfer, cut into chunks; `final`: its last ones."""

    destination: KvDestination
    chunks: list[KvChunk]
    final: bool
    traceparent: str = ""  # the request's: its transfer is a span of its trace


def gather(cache: KVCache, destination: KvDestination, source_blocks: list[int],
           first: int, max_bytes: int, final: bool, traceparent: str = "") -> Outgoing:
    """Copy blocks `source_blocks` (this cache's) out as chunks for the destination's blocks
    from prompt block `first` on. A chunk holds as many whole blocks as fit in `max_bytes`;
    a block bigger than that goes by layers."""
    offset = first - destination.first_block
    targets = destination.block_ids[offset:offset + len(source_blocks)]
    num_layers = cache.k.shape[0]
    layer_bytes = cache.k[0, 0].numel() * cache.k.element_size() * 2  # K and V of one block
    budget = max(max_bytes - CHUNK_OVERHEAD_BYTES, layer_bytes)
    layers_per_chunk = min(num_layers, budget // layer_bytes)
    blocks_per_chunk = max(1, budget // (layer_bytes * num_layers)) if \
        layers_per_chunk == num_layers else 1
    chunks = []
    for b in range(0, len(source_blocks), blocks_per_chunk):
        index = torch.tensor(source_blocks[b:b + blocks_per_chunk], dtype=torch.int64)
        for layer in range(0, num_layers, layers_per_chunk):
            count = min(layers_per_chunk, num_layers - layer)
            chunks.append(KvChunk(
                transfer_id=destination.transfer_id,
                block_ids=targets[b:b + blocks_per_chunk], first_layer=layer,
                num_layers=count, k=_raw(cache.k[layer:layer + count, index]),
                v=_raw(cache.v[layer:layer + count, index])))
    return Outgoing(destination, chunks, final, traceparent)


def _raw(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes (msgspec encodes a memoryview as it does bytes: no copy here)."""
    flat = tensor.contiguous().view(torch.uint8).reshape(-1).cpu()  # a GPU's: copied out
    return memoryview(flat.numpy())  # type: ignore[return-value]


@dataclass
class _Prefill:
    """One sequence prefilled for another engine: where its blocks go, and how many of its
    prompt's blocks are gathered so far (counted from the prompt's first block)."""

    destination: KvDestination
    num_prompt_tokens: int
    traceparent: str
    num_blocks_gathered: int


class KvGathering:
    """The prefills this executor runs for other engines, and what it gathered of them that
    the service has not taken yet. Used in the forward thread only; the service takes the
    outbox between steps."""

    def __init__(self, cache: KVCache, block_size: int) -> None:
        self.cache, self.block_size = cache, block_size
        self.chunk_bytes = 1 << 20  # the bus's max_payload: the service sets it
        self._prefills: dict[str, _Prefill] = {}  # by sequence_id
        self._outbox: list[Outgoing] = []
        self._dropped: list[str] = []  # transfers of sequences forgotten (their sends stop)

    def start(self, new: NewRequestData) -> None:
        """A new sequence: gathered for another engine if it has a destination."""
        destination = new.kv_destination
        if destination is not None:
            self._prefills[new.sequence_id] = _Prefill(
                destination, len(new.prompt_token_ids), new.traceparent,
                destination.first_block)

    def stop(self, sequence_id: str) -> None:
        """The sequence is forgotten: whatever of its transfer is not sent yet never is."""
        prefill = self._prefills.pop(sequence_id, None)
        if prefill is not None:
            self._dropped.append(prefill.destination.transfer_id)

    def gather_filled(self, scheduled: list[ScheduledRequest],
                      block_table: Callable[[str], list[int]]) -> None:
        """After a step's forward: copy out the prompt blocks it filled of each prefill for
        another engine (the last, partial one with the prompt's end)."""
        if not self._prefills:
            return
        for sched in scheduled:
            prefill = self._prefills.get(sched.sequence_id)
            if prefill is None:
                continue
            end = sched.start + sched.num_tokens
            final = end >= prefill.num_prompt_tokens
            upto = (-(-prefill.num_prompt_tokens // self.block_size) if final
                    else end // self.block_size)
            if upto > prefill.num_blocks_gathered or final:
                self._outbox.append(gather(
                    self.cache, prefill.destination,
                    block_table(sched.sequence_id)[prefill.num_blocks_gathered:upto],
                    prefill.num_blocks_gathered, self.chunk_bytes, final, prefill.traceparent))
                prefill.num_blocks_gathered = upto

    def take(self) -> tuple[list[Outgoing], list[str]]:
        """Blocks gathered since the last call, and the transfers of sequences forgotten."""
        outbox, self._outbox = self._outbox, []
        dropped, self._dropped = self._dropped, []
        return outbox, dropped

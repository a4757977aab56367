"""The residual stream between pipeline shards: raw bytes, split by rows under the bus's
max_payload, and put back together bit for bit.

A step's hidden states [T, D] go from the lead shard to each layer shard and back
(layer_slice.py) in the dtype the backend computes in: 4 bytes a value for the CPU backends,
so D x 4 bytes a token (2,304 for the default model, 8 KB for a 1B model).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmbus.services.executor.attention.metadata import AttentionMetadata

# Each sequence's query and context lengths and block table: what a layer shard rebuilds a
# step's attention metadata from.
Geometry = tuple[list[int], list[int], list[list[int]]]
ENVELOPE_BYTES = 4096  # NATS headers (trace context) and a part's small fields; the lead measures
# the first part's geometry (block tables) apart


def hidden_parts(hidden: torch.Tensor, max_bytes: int) -> list[bytes]:
    """hidden [T, D] as raw bytes in parts of whole rows, each at most `max_bytes` (one row
    per part at least)."""
    rows = hidden.contiguous()
    row_bytes = rows.shape[1] * rows.element_size()
    per_part = max(1, max_bytes // row_bytes)
    flat = rows.view(torch.uint8).reshape(rows.shape[0], row_bytes)
    return [flat[start:start + per_part].numpy().tobytes()
            for start in range(0, rows.shape[0], per_part)] or [b""]


def hidden_from_parts(parts: Sequence[bytes], hidden_size: int, dtype: str) -> torch.Tensor:
    """The [T, D] tensor of `hidden_parts`' output, in order."""
    data = bytearray(b"".join(parts))
    if not data:
        return torch.empty(0, hidden_size, dtype=getattr(torch, dtype))
    return torch.frombuffer(data, dtype=getattr(torch, dtype)).view(-1, hidden_size)


def step_geometry(meta: AttentionMetadata) -> Geometry:
    """What a layer shard needs to rebuild `meta` (build_attention_metadata): each sequence's
    query and context lengths, and the blocks its context fills."""
    query_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
    context_lens = meta.context_lens.tolist()
    tables = meta.block_tables.tolist()
    return query_lens, context_lens, [
        table[:-(-length // meta.block_size)] for table, length in zip(tables, context_lens,
                                                                       strict=True)]

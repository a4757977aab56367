"""Where each sequence's queries and keys live in one step: built once per step on the host,
shared by every layer and every attention implementation.

A step is one flat token stream: T tokens from B sequences, each a prefill chunk or a decode
token (shapes: T tokens, B sequences, L padded context length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmbus.services.executor.kv_cache import NULL_BLOCK_ID


@dataclass
class AttentionLayout:
    """Padded torch layout of one group of sequences (decodes, or prefill chunks).

    Decodes and prefill chunks are attended to separately: padding a decode's single query to
    a 500-token prefill chunk would multiply its work by 500. K/V are gathered whole blocks at
    a time (`index_select` on the block axis copies rows, 5x faster than per-slot indexing).
    """

    token_index: torch.Tensor  # [Tg] flat indices of this group's tokens
    query_gather: torch.Tensor  # [Bg, max_q] flat index of each padded query (pads repeat)
    query_scatter: torch.Tensor  # [Tg] index of each token in the padded [Bg * max_q] queries
    kv_blocks: torch.Tensor  # [Bg * blocks] int64 block ids, row-major (pads: block 0)
    context_width: int  # blocks * block_size: the padded context length L
    attn_mask: torch.Tensor  # [Bg, 1, max_q, L] bool, True = may attend
    query_positions: torch.Tensor  # [Bg, max_q] int64 (pads run past the context)
    _folded_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def folded_mask(self, group: int, window: int = 0) -> torch.Tensor:
        """The mask for queries folded as [Bg, Hkv, group * max_q] (torch_paged.attend_layout);
        `window` > 0 also hides keys more than `window - 1` positions before each query."""
        key = (group, window)
        if key not in self._folded_masks:
            mask = self.attn_mask
            if window:
                keys = torch.arange(self.context_width, device=mask.device)
                mask = mask & (keys > self.query_positions[:, None, :, None] - window)
            # decodes: one query per sequence, the mask broadcasts over the group
            self._folded_masks[key] = mask if mask.shape[2] == 1 else mask.repeat(
                1, 1, group, 1)
        return self._folded_masks[key]


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys live in this step; shared by every layer."""

    cu_seqlens_q: torch.Tensor  # [B+1] int64, query start offsets into the flat stream
    context_lens: torch.Tensor  # [B] int64, tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each new token
    positions: torch.Tensor  # [T] int64
    block_size: int
    max_query_len: int  # a host int, so kernel launches need no device sync
    # Layouts for the torch attention, computed once per step instead of once per layer.
    layouts: list[AttentionLayout]


def build_attention_metadata(
    query_lens: Sequence[int], context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Sequence b computes positions [context_lens[b] - query_lens[b], context_lens[b])."""
    num_seqs = len(query_lens)
    max_ctx = max(context_lens)
    num_blocks = -(-max_ctx // block_size)
    padded = [list(bt[:num_blocks]) + [NULL_BLOCK_ID] * (num_blocks - min(len(bt), num_blocks))
              for bt in block_tables]
    table = torch.tensor(padded, dtype=torch.int32, device=device)  # [B, max_blocks]
    q_lens = torch.tensor(query_lens, dtype=torch.int64, device=device)  # [B]
    ctx = torch.tensor(context_lens, dtype=torch.int64, device=device)  # [B]
    cu = F.pad(torch.cumsum(q_lens, 0), (1, 0))  # [B+1]
    num_tokens = int(cu[-1])

    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)  # [T]
    index_in_seq = torch.arange(num_tokens, device=device) - cu[seq]  # [T]
    positions = ctx[seq] - q_lens[seq] + index_in_seq  # [T]
    slot_mapping = table[seq, positions // block_size].long() * block_size \
        + positions % block_size  # [T]

    decode_ids = [b for b, n in enumerate(query_lens) if n == 1]
    prefill_ids = [b for b, n in enumerate(query_lens) if n > 1]
    layouts = [_layout(ids, query_lens, context_lens, table, cu, block_size, device)
               for ids in (decode_ids, prefill_ids) if ids]
    return AttentionMetadata(
        cu_seqlens_q=cu, context_lens=ctx, block_tables=table, slot_mapping=slot_mapping,
        positions=positions, block_size=block_size, max_query_len=max(query_lens),
        layouts=layouts)


def _layout(seq_ids: list[int], query_lens: Sequence[int], context_lens: Sequence[int],
            table: torch.Tensor, cu: torch.Tensor, block_size: int,
            device: torch.device | str) -> AttentionLayout:
    """The padded layout of the sequences `seq_ids` (indices into the step's batch)."""
    ids = torch.tensor(seq_ids, dtype=torch.int64, device=device)  # [Bg]
    q_lens = torch.tensor([query_lens[b] for b in seq_ids], dtype=torch.int64,
                          device=device)  # [Bg]
    ctx = torch.tensor([context_lens[b] for b in seq_ids], dtype=torch.int64,
                       device=device)  # [Bg]
    max_q, max_ctx = int(q_lens.max()), int(ctx.max())
    num_blocks = -(-max_ctx // block_size)
    width = num_blocks * block_size  # L
    starts = cu[ids]  # [Bg] flat offset of each sequence's first query
    local = torch.repeat_interleave(torch.arange(len(seq_ids), device=device), q_lens)  # [Tg]
    local_cu = F.pad(torch.cumsum(q_lens, 0), (1, 0))  # [Bg+1]
    index_in_seq = torch.arange(int(local_cu[-1]), device=device) - local_cu[local]  # [Tg]
    qi = torch.arange(max_q, device=device)  # [max_q]
    kj = torch.arange(width, device=device)  # [L]
    q_pos = (ctx - q_lens)[:, None] + qi[None]  # [Bg, max_q]; pads run past ctx: no empty rows
    attn_mask = (kj[None, None] <= q_pos[:, :, None]) & (kj[None, None] < ctx[:, None, None])
    return AttentionLayout(
        token_index=starts[local] + index_in_seq,
        query_gather=starts[:, None] + torch.minimum(qi[None], q_lens[:, None] - 1),
        query_scatter=local * max_q + index_in_seq,
        kv_blocks=table[ids][:, :num_blocks].reshape(-1).long(), context_width=width,
        attn_mask=attn_mask[:, None], query_positions=q_pos)

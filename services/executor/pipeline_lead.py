"""The lead shard's forward over a model split by layers: its own layers, the other shards'
(over the bus), then the head; a big step cut into micro-batches that the shards compute at
once.

Pure: `send(hidden, geometry)` carries one micro-batch's hidden states through the other
shards and returns a future of their output (pipeline_lead_bus.py sends them, in order). A
micro-batch is a contiguous range of the step's tokens, which may cut a prompt chunk in two:
the second part's queries attend to the first part's keys, which every shard has written by
then, since each shard takes the micro-batches in order. With two shards, the lead computes
micro-batch 2's layers while shard 1 computes micro-batch 1's: a step's time falls from 4 to
3 half-model passes. Only steps of compute-bound size are cut (MICRO_BATCH_MIN_TOKENS): a
step of a few decodes reads every weight whatever its rows, and cutting it would read them
twice.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from concurrent.futures import Future

import torch

from llmbus.services.executor.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
)
from llmbus.services.executor.backend import Backend
from llmbus.services.executor.hidden_handoff import Geometry, step_geometry
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.plan_overlap import LeadTurns

# A micro-batch's tokens, at least. A matmul of a few rows is bound by reading its weights,
# which each micro-batch reads again; of many, by its arithmetic, which micro-batches overlap.
# (2 Xeon cores, a 1B Q4_K_M file, 8 streams: 0.54x a whole engine's throughput on both cores
# with 64, where the steps of 8 decodes and a 32-token chunk stayed whole; 0.63x with 16.)
MICRO_BATCH_MIN_TOKENS = 16


def token_ranges(query_lens: list[int], num_shards: int,
                 min_tokens: int = MICRO_BATCH_MIN_TOKENS) -> list[tuple[int, int]]:
    """The step's tokens (each sequence's `query_lens`, in order) in as many even, contiguous
    ranges as there are shards, each of at least `min_tokens` (one range for a smaller step).
    No cut leaves one token of a longer query alone on either side: that token would attend
    as a decode, the attention kernel's other path, whose last bits differ from a chunk row's,
    and the split engine's output would drift from the whole engine's."""
    num_tokens = sum(query_lens)
    count = max(1, min(num_shards, num_tokens // min_tokens))
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    cuts = []
    for k in range(1, count):
        cut = num_tokens * k // count
        at = bisect.bisect_right(starts, cut)  # the cut falls in sequence at - 1
        start, end = starts[at - 1], starts[at]
        if cut - start == 1 and end - start > 1:
            cut = start
        elif end - cut == 1 and end - start > 1:
            cut = end
        cuts.append(cut)
    bounds = sorted({0, num_tokens, *cuts})
    return list(zip(bounds, bounds[1:], strict=False))


def sub_geometry(geometry: Geometry, first: int, end: int) -> Geometry:
    """The geometry of tokens [first, end) of the step: each sequence's part of that range,
    its context counted to the part's last token."""
    query_lens, context_lens, tables = [], [], []
    start = 0
    for query_len, context_len, table in zip(*geometry, strict=True):
        stop = start + query_len
        low, high = max(first, start), min(end, stop)
        if low < high:
            query_lens.append(high - low)
            context_lens.append(context_len - (stop - high))
            tables.append(table)
        start = stop
    return query_lens, context_lens, tables


class PipelinedForward:
    """Backend.forward's contract for the lead shard of a split model."""

    def __init__(self, model: Backend, send: Callable[[torch.Tensor, Geometry],
                                                      Future[torch.Tensor]],
                 num_shards: int, min_tokens: int = MICRO_BATCH_MIN_TOKENS,
                 turns: LeadTurns | None = None) -> None:
        """`turns`: the lead's, if it computes another plan while this one is in the other
        shards (plan_overlap.py)."""
        self.model, self.send, self.num_shards = model, send, num_shards
        self.min_tokens = min_tokens
        self.turns = turns

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, kv_cache: KVCache,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        model, geometry = self.model, step_geometry(meta)
        ranges = token_ranges(geometry[0], self.num_shards, self.min_tokens)
        outputs = []
        for first, end in ranges:
            part = geometry if len(ranges) == 1 else sub_geometry(geometry, first, end)
            part_meta = meta if len(ranges) == 1 else build_attention_metadata(
                *part, meta.block_size, input_ids.device)
            hidden = model.forward_layers(model.embed_tokens(input_ids[first:end]),
                                          part_meta.positions, part_meta, kv_cache)
            outputs.append(self.send(hidden, part))  # the shards start on it; on to the next
        def through_shards() -> list[torch.Tensor]:
            return [output.result() for output in outputs]
        hidden = torch.cat(through_shards() if self.turns is None
                           else self.turns.away(through_shards))
        return model.logits(hidden, logits_indices)

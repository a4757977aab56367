"""A text of a random model's own, for perplexity comparisons (design invariant 3): random
weights have no English to be scored on, so the exact mode samples NUM_TOKENS tokens and each
mode then scores them through its own forward and cache."""

from __future__ import annotations

import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.kv_cache import KVCache

NUM_TOKENS, BLOCKS = 300, 24


def sampled_text(model, config, seed: int = 0) -> list[int]:
    """NUM_TOKENS tokens sampled (temperature 1) from the model, one decode step at a time."""
    generator = torch.Generator().manual_seed(seed)
    cache, table, ids = KVCache(config, BLOCKS + 1, 16, torch.float32), list(
        range(1, BLOCKS + 1)), [5]
    with torch.inference_mode():
        for _ in range(NUM_TOKENS - 1):
            meta = build_attention_metadata([1], [len(ids)], [table], 16)
            logits = model.forward(torch.tensor(ids[-1:]), meta.positions, meta, cache,
                                   torch.tensor([0]))
            ids.append(int(torch.multinomial(torch.softmax(logits[0], -1), 1,
                                             generator=generator)))
    return ids

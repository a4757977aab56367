"""Perplexity of a model on a fixed text: how the fast modes' quality is held to the exact one.

The text is run through the model's own forward in prefill chunks over a paged KV cache (the
serving code path), scoring every next token; perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math

import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.kv_cache import KVCache


def perplexity(model, kv_cache: KVCache, token_ids: list[int], chunk_size: int = 256) -> float:
    """exp of the mean NLL of token_ids[1:] given their prefixes; the cache must hold them all.

    `model` is a LlamaModel or an CpuLlamaModel; `kv_cache` is overwritten.
    """
    block_size = kv_cache.block_size
    num_blocks = -(-len(token_ids) // block_size)
    if num_blocks >= kv_cache.num_blocks:
        raise ValueError(f"{len(token_ids)} tokens need {num_blocks} blocks besides the null "
                         f"one; the cache has {kv_cache.num_blocks}")
    block_table = list(range(1, num_blocks + 1))
    ids = torch.tensor(token_ids)
    total_nll, num_scored = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(token_ids) - 1, chunk_size):
            end = min(start + chunk_size, len(token_ids) - 1)  # the last token is only a target
            meta = build_attention_metadata([end - start], [end], [block_table], block_size)
            logits = model.forward(ids[start:end], meta.positions, meta, kv_cache,
                                   torch.arange(end - start))  # [chunk, V]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = ids[start + 1:end + 1]
            total_nll -= logprobs.gather(1, targets[:, None]).sum().item()
            num_scored += end - start
    return math.exp(total_nll / num_scored)

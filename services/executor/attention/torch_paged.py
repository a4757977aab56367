"""The torch reference of attention over the paged cache: RoPE and the K/V write, then causal
attention of every query over its sequence's cached context. The CPU's C++ kernel
(cpu_paged.py) and the Triton kernels (kernels/triton/) are checked against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmbus.services.executor.attention.metadata import AttentionLayout, AttentionMetadata
from llmbus.services.executor.attention.rope import apply_rope


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V ([T, Hkv, Dh]) into caches [num_blocks, block_size, Hkv, Dh]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of q [T, H, Dh] over each sequence's cached context -> [T, H * Dh];
    `window` > 0: over its last `window` positions only (a sliding-window layer).

    Torch reference path: per layout (decodes, prefill chunks), gather the paged KV into
    padded per-sequence tensors and run one batched SDPA. For GQA the `group = H // Hkv` query
    heads sharing a KV head are folded into the query-length axis, so K/V are never repeated.
    """
    num_tokens, num_heads, head_dim = q.shape
    if len(meta.layouts) == 1 and meta.layouts[0].token_index.numel() == num_tokens:
        # one group: no scatter
        return attend_layout(q, k_cache, v_cache, meta.layouts[0], scale, window)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for layout in meta.layouts:
        out[layout.token_index] = attend_layout(q, k_cache, v_cache, layout, scale, window)
    return out


def attend_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  layout: AttentionLayout, scale: float, window: int = 0) -> torch.Tensor:
    """Attention of one layout's tokens -> [Tg, H * Dh], in the layout's token order.

    For GQA the `group = H // Hkv` query heads sharing a KV head are folded into the query
    axis, so K/V are never repeated.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs, max_q = layout.query_gather.shape
    shape = (num_seqs, layout.context_width, num_kv_heads, head_dim)
    # A float16 cache under float32 compute (the ONNX Runtime path) is widened after the gather.
    k = k_cache.index_select(0, layout.kv_blocks).view(shape).to(q.dtype)  # [Bg, L, Hkv, Dh]
    v = v_cache.index_select(0, layout.kv_blocks).view(shape).to(q.dtype)  # [Bg, L, Hkv, Dh]
    qp = q[layout.query_gather]  # [Bg, max_q, H, Dh]
    qp = qp.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)  # [Bg, Hkv, g*max_q, Dh]
    out = F.scaled_dot_product_attention(
        qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=layout.folded_mask(group, window),
        scale=scale)  # [Bg, Hkv, g*max_q, Dh]
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, num_heads * head_dim)  # [Bg*max_q, H*Dh]
    return out[layout.query_scatter]  # [Tg, H*Dh]


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * Dh], cos/sin [T, Dh] -> q [T, H, Dh]; K/V into the caches."""
    num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
    qk_width = (num_heads + num_kv_heads) * head_dim
    # RoPE on Q and K in one pass: [T, H + Hkv, Dh]
    qk = apply_rope(qkv[:, :qk_width].view(num_tokens, -1, head_dim), cos[:, None],
                    sin[:, None])
    q, k = qk[:, :num_heads], qk[:, num_heads:]  # [T, H, Dh], [T, Hkv, Dh]
    v = qkv[:, qk_width:].view(num_tokens, num_kv_heads, head_dim)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q

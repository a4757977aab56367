"""Qwen3's RMSNorm of each query and key head, between the QKV projection and RoPE.

Computed as HF transformers computes it (Qwen3RMSNorm): in float32, then scaled by the weight
in the input's dtype, so the exact mode keeps its equality with the reference.
"""

from __future__ import annotations

import torch


def qk_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                num_heads: int, num_kv_heads: int, eps: float) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * Dh] -> the same, with each Q and K head normalised; V as is."""
    num_tokens, head_dim = qkv.shape[0], q_weight.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)

    def norm(x: torch.Tensor, heads: int, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.reshape(num_tokens, heads, head_dim).float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * x32.to(qkv.dtype)).reshape(num_tokens, heads * head_dim)

    return torch.cat([norm(q, num_heads, q_weight), norm(k, num_kv_heads, k_weight), v], dim=-1)

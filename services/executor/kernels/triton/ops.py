"""The model's Triton backend: the same calls as `model.TorchOps`, each one fused kernel.

`LlamaModel` picks this on CUDA; tests force it under the interpreter to compare whole
forwards with the torch backend.
"""

from __future__ import annotations

import torch

from llmbus.services.executor.kernels.triton.paged_decode_attention import paged_decode_attention
from llmbus.services.executor.kernels.triton.prefill_attention import prefill_attention
from llmbus.services.executor.kernels.triton.rmsnorm import add_rms_norm, rms_norm
from llmbus.services.executor.kernels.triton.rope_kv import rope_kv
from llmbus.services.executor.kernels.triton.swiglu import swiglu


class TritonOps:
    name = "triton"

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x is None:
            return rms_norm(residual, weight, eps), residual
        return add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
        return rope_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)

    @staticmethod
    def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                  scale: float, window: int = 0) -> torch.Tensor:
        """q [T, H, Dh] -> [T, H * Dh]; an all-decode step takes the split-K decode kernel.
        `window` > 0: a sliding-window layer's."""
        num_tokens = q.shape[0]
        max_query_len = meta.max_query_len  # a host int: no device sync
        if max_query_len == 1:
            out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                         meta.context_lens, scale, window=window)
        else:
            out = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                    meta.context_lens, max_query_len, scale, window=window)
        return out.view(num_tokens, -1)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up)

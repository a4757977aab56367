"""One C++ call per layer for RoPE, the KV write and attention (paged_attention.cpp).

Every query attends straight from the cache blocks (float32 or float16 cache): decodes,
decodes sharing a cached prefix, and prefill chunks up to `KERNEL_MAX_QUERY_LEN` tokens, whose
longer kin get torch SDPA over the gathered blocks (`attend_layout`). The torch reference of
the whole call is `torch_paged.rope_write_kv` followed by `torch_paged.paged_attention`.
"""

from __future__ import annotations

import ctypes

import torch

from llmbus.services.executor.attention.metadata import AttentionMetadata
from llmbus.services.executor.attention.torch_paged import attend_layout

# Queries per sequence up to which the kernel attends; longer chunks go to SDPA. The kernel
# measured faster at every length tried (2 Zen 4 cores: a fresh 256-token prompt 0.8 ms per
# layer against 2.4 ms, 16 chunks of 32 behind a 1,024-token prefix 9.9 against 16.0 ms).
KERNEL_MAX_QUERY_LEN = 8192
KV_DTYPES = (torch.float32, torch.float16)


class PagedAttention:
    """`__call__(qkv, cos, sin, k_cache, v_cache, meta, num_heads, scale, window)` ->
    [T, H * Dh]."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int) -> None:
        self._kernels = {torch.float32: lib.paged_attention_f32,
                         torch.float16: lib.paged_attention_f16}
        self.num_threads = num_threads

    @staticmethod
    def takes_whole(meta: AttentionMetadata) -> bool:
        """Whether every query of the step is the kernel's (none goes to SDPA)."""
        return all(layout.query_gather.shape[1] <= KERNEL_MAX_QUERY_LEN
                   for layout in meta.layouts)

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 num_heads: int, scale: float, window: int = 0) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) * Dh] float32, cos/sin [T, Dh]; caches
        [num_blocks, block_size, Hkv, Dh]. Writes the step's K/V into the caches. `window`
        > 0: each query attends to its last `window` positions only."""
        num_tokens = qkv.shape[0]
        num_kv_heads, head_dim = k_cache.shape[2:]
        if qkv.dtype != torch.float32 or k_cache.dtype not in KV_DTYPES \
                or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"expected float32 qkv and a float32/float16 cache, got "
                             f"{qkv.dtype} and {k_cache.dtype}/{v_cache.dtype}")
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or not (
                qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {num_heads} + 2 x "
                             f"{num_kv_heads} heads of {head_dim}, or is not contiguous")
        q = torch.empty(num_tokens, num_heads, head_dim)
        out = torch.empty(num_tokens, num_heads * head_dim)
        tables = meta.block_tables
        cos, sin = cos.contiguous(), sin.contiguous()
        status = self._kernels[k_cache.dtype](
            qkv.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
            sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
            meta.cu_seqlens_q.data_ptr(), meta.context_lens.data_ptr(), tables.shape[0],
            meta.block_size, KERNEL_MAX_QUERY_LEN, scale, q.data_ptr(), out.data_ptr(),
            self.num_threads, window)
        if status != 0:
            raise RuntimeError(f"paged attention kernel failed ({status}): head_dim "
                               f"{head_dim}, {num_heads} / {num_kv_heads} heads")
        for layout in meta.layouts:
            if layout.query_gather.shape[1] > KERNEL_MAX_QUERY_LEN:  # prefill chunks
                out[layout.token_index] = attend_layout(q, k_cache, v_cache, layout, scale,
                                                        window)
        return out

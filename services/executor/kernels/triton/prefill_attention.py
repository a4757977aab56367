"""Causal attention for prefill chunks over the paged KV cache, variable lengths in one batch.

Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of the flat stream; with
q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b] and L = context_lens[b], its query i sits at
position L - q_len + i and attends every cached position j <= that (the cached prefix and the
chunk itself, whose K/V the step already wrote), so chunked prefill and prefix-cache hits are
one case:

    out[t, h] = sum_j softmax_j(scale * q[t, h] . K[b, j]) V[b, j],   j <= pos(t)
                                        (and j > pos(t) - window with a sliding window)

K/V come through `block_tables[b]` as in decode; a mixed batch (decode tokens are chunks of
one) works too. Each program walks keys only up to its last query's position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmbus.services.executor.kernels.triton._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check,
    check_cache,
    check_device,
    check_tensor,
    interpreting,
)
from llmbus.services.executor.kernels.triton._paged import kv_slot_offsets, online_softmax_step
from llmbus.services.executor.kernels.triton._rounding import to_dtype

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    out_ptr, qk_scale, block_size, window, stride_q_t, stride_q_h, stride_out_t, stride_out_h,
    stride_table, stride_cache_block, stride_cache_slot, stride_cache_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    tile, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] query index within the sequence
    d = tl.arange(0, BLOCK_D)  # [D]
    d_mask = d[None, :] < HEAD_DIM
    row_mask = (i[:, None] < q_len) & d_mask  # [M, D]
    rows = (q_start + i).to(tl.int64)[:, None]
    q = tl.load(q_ptr + rows * stride_q_t + head * stride_q_h + d[None, :], mask=row_mask,
                other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # Pad rows (i >= q_len) sit past the context and see every key: no row is empty.
    q_pos = context_len - q_len + i  # [M]
    kv_end = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)  # tiles past the chunk do nothing
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    kv_head = head // GROUP
    # with a window, keys before the tile's first query's window are never read
    first = tl.where(window > 0, tl.maximum(context_len - q_len + tile * BLOCK_M - window + 1,
                                            0), 0)
    for n0 in range(first, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [N]
        n_mask = n < kv_end
        offsets = kv_slot_offsets(table, n, n_mask, block_size, stride_cache_block,
                                  stride_cache_slot) + kv_head * stride_cache_head
        kv_mask = n_mask[:, None] & d_mask  # [N, D]
        k = tl.load(k_cache_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        valid = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]  # [M, N]
        valid = valid & ((window == 0) | (n[None, :] > q_pos[:, None] - window))
        m_i, l_i, acc = online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_FP32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + rows * stride_out_t + head * stride_out_h + d[None, :]
    tl.store(dst, to_dtype(out, out_ptr.dtype.element_ty), mask=row_mask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, max_query_len: int,
                      scale: float, window: int = 0) -> torch.Tensor:
    """q [T, H, Dh] -> [T, H, Dh], causal over each sequence's cached context; `window` > 0:
    over each query's last `window` positions only (a sliding-window layer).

    cu_seqlens_q [B+1]; context_lens [B] (tokens cached after this step, >= the chunk);
    block_tables [B, max_blocks] int32. `max_query_len` (a host int, the longest chunk)
    sizes the grid so the launch needs no device sync.
    Grid: (cdiv(max_query_len, BLOCK_M), H, B).
    """
    device, dtype = q.device, q.dtype
    check_device(device)
    check_tensor(q, "q", (None, None, None), FLOAT_DTYPES, device)
    check_cache(k_cache, v_cache, dtype, device)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check(k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q's {head_dim}")
    check(num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} KV heads")
    num_seqs = block_tables.shape[0]
    check_tensor(block_tables, "block_tables", (num_seqs, None), (torch.int32,), device)
    check_tensor(cu_seqlens_q, "cu_seqlens_q", (num_seqs + 1,), INDEX_DTYPES, device)
    check_tensor(context_lens, "context_lens", (num_seqs,), INDEX_DTYPES, device)
    check(max_query_len >= 1 or num_tokens == 0, f"max_query_len {max_query_len} < 1")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    if num_tokens == 0:
        return out
    block_m = 16 if interpreting() else 64
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale * _LOG2E,
        block_size, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
        BLOCK_N=16 if interpreting() else 64, DOT_FP32=dtype == torch.float32 or interpreting())
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                window: int = 0) -> torch.Tensor:
    """Per sequence: gather its context, causal (and windowed) softmax in float32."""
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        j = torch.arange(context_len, device=q.device)
        slots = block_tables[b, j // block_size].long() * block_size + j % block_size
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)  # [L, H, Dh]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
        q_pos = context_len - (end - start) + torch.arange(end - start, device=q.device)
        scores = torch.einsum("qhd,lhd->hql", q[start:end].float(), k) * scale
        hidden = j[None, None] > q_pos[None, :, None]
        if window:
            hidden |= j[None, None] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out

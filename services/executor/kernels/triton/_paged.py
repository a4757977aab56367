"""Pieces shared by the two paged attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_slot_offsets(block_table_ptr, positions, mask, block_size, stride_block, stride_slot):
    """Element offsets of context positions [N] in a cache [num_blocks, block_size, Hkv, Dh].

    Masked positions read the null block 0, so the offsets stay inside the cache.
    """
    blocks = tl.load(block_table_ptr + positions // block_size, mask=mask, other=0)
    return blocks.to(tl.int64) * stride_block + (positions % block_size).to(tl.int64) * stride_slot


@triton.jit
def online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr):
    """One tile of flash attention: q [M, D], k/v [N, D], valid [M, N] -> new (m, l, acc).

    Scores live in the log2 domain (qk_scale includes log2(e)) so exp2 does the softmax. A row
    may see no valid key in a tile (a sliding window that begins after it): it stays as it was
    (m -inf, l 0 until its first valid key).
    """
    if DOT_FP32:  # the interpreter's bf16 dot is wrong, and fp32 inputs want full precision
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, N]
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf for an empty row
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc

"""Paged attention for decode: one query token per sequence, split over the context.

For sequence b with context length L_b and query head h (KV head h // group, GQA):

    out[b, h] = sum_j softmax_j(scale * q[b, h] . K[b, j]) V[b, j],   j < L_b
                                                  (and j >= L_b - window with a window)

where K/V[b, j] live at block `block_tables[b, j // block_size]`, offset `j % block_size`.
A decode step has too few rows to fill a GPU with one program per (sequence, KV head), so the
context is cut into partitions of `partition_size` tokens (flash-decoding): each program
softmaxes one partition for all `group` query heads of one KV head (K/V are read once), and a
reduce kernel merges the partitions with their max and sum. One partition skips the reduce.
How finely to cut is `partition_size_for`: as coarse as still keeps every multiprocessor busy.
"""

from __future__ import annotations

from functools import cache

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
# Programs per multiprocessor a launch should give, and the partition sizes to choose from: 512
# keeps the partials (and the reduce) small where the batch fills the GPU; 32 is two blocks of
# 16, below which a program's loads are too short to hide their latency.
PROGRAMS_PER_MULTIPROCESSOR = 2
LARGEST_PARTITION, SMALLEST_PARTITION = 512, 32


def partition_size_for(num_seqs: int, num_kv_heads: int, max_context: int,
                       multiprocessors: int) -> int:
    """The largest power-of-two partition (512 down to 32) whose grid still gives every
    multiprocessor PROGRAMS_PER_MULTIPROCESSOR programs. One sequence of 4,096 tokens on a
    132-SM H200 with 3 KV heads reads its context in 8 x 3 = 24 programs at 512 (a fifth of the
    chip idles) and in 128 x 3 at 32; 64 sequences of 2,048 fill it at 512."""
    target = PROGRAMS_PER_MULTIPROCESSOR * multiprocessors
    size = LARGEST_PARTITION
    while size > SMALLEST_PARTITION and \
            num_seqs * num_kv_heads * triton.cdiv(max_context, size) < target:
        size //= 2
    return size


@cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count; 1 under the interpreter, where partitions run one by one."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr, qk_scale, block_size, num_partitions, window,
    stride_q_b, stride_q_h, stride_out_b, stride_out_h, stride_table,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    # a sliding window's first key: partitions before it read nothing, and stay empty
    first = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    start = tl.maximum(part * PARTITION_SIZE, first)
    end = tl.minimum(part * PARTITION_SIZE + PARTITION_SIZE, context_len)
    g = tl.arange(0, BLOCK_G)  # [G] query heads of this KV head (padded)
    d = tl.arange(0, BLOCK_D)  # [D]
    heads = kv_head * GROUP + g
    row_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)  # [G, D]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + d[None, :],
                mask=row_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):  # empty for partitions past the context
        n = n0 + tl.arange(0, BLOCK_N)  # [N]
        n_mask = n < end
        offsets = kv_slot_offsets(table, n, n_mask, block_size, stride_cache_block,
                                  stride_cache_slot) + kv_head * stride_cache_head
        kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)  # [N, D]
        k = tl.load(k_cache_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_softmax_step(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale,
                                             DOT_FP32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [G, D]; 0 for an empty partition
    if SPLIT:
        row = (seq.to(tl.int64) * tl.num_programs(1) + kv_head) * GROUP + g  # [G] b * H + h
        stat = row * num_partitions + part
        tl.store(part_max_ptr + stat, m_i, mask=g < GROUP)
        tl.store(part_sum_ptr + stat, l_i, mask=g < GROUP)
        tl.store(part_out_ptr + stat[:, None] * HEAD_DIM + d[None, :], out, mask=row_mask)
    else:
        dst = out_ptr + seq.to(tl.int64) * stride_out_b + heads[:, None] * stride_out_h
        tl.store(dst + d[None, :], to_dtype(out, out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr, out_ptr, num_partitions,
    stride_out_b, stride_out_h,
    PARTITION_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    p = tl.arange(0, BLOCK_P)  # [P]
    d = tl.arange(0, BLOCK_D)  # [D]
    p_mask = p < tl.cdiv(context_len, PARTITION_SIZE)
    stat = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_partitions + p  # [P]
    m = tl.load(part_max_ptr + stat, mask=p_mask, other=float("-inf"))
    weight = tl.exp2(m - tl.max(m, axis=0)) * tl.load(part_sum_ptr + stat, mask=p_mask,
                                                      other=0.0)  # [P]
    out = tl.load(part_out_ptr + stat[:, None] * HEAD_DIM + d[None, :],
                  mask=p_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # [P, D]
    out = tl.sum(weight[:, None] * out, axis=0) / tl.sum(weight, axis=0)  # [D]
    dst = out_ptr + seq.to(tl.int64) * stride_out_b + head * stride_out_h + d
    tl.store(dst, to_dtype(out, out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           partition_size: int | None = None,
                           window: int = 0) -> torch.Tensor:
    """q [B, H, Dh] (one token per sequence) -> [B, H, Dh]; `window` > 0: over each
    sequence's last `window` positions only (a sliding-window layer).

    Caches [num_blocks, block_size, Hkv, Dh]; block_tables [B, max_blocks] int32 (padding
    points at block 0); context_lens [B], each >= 1, covering the token being decoded. The
    number of partitions comes from max_blocks, so the launch needs no device sync;
    `partition_size` None: `partition_size_for` this batch on this device.
    Grid: (B, Hkv, partitions), then (B, H) for the reduce when partitions > 1.
    """
    device, dtype = q.device, q.dtype
    check_device(device)
    check_tensor(q, "q", (None, None, None), FLOAT_DTYPES, device)
    check_cache(k_cache, v_cache, dtype, device)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check(k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q's {head_dim}")
    check(num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} KV heads")
    check_tensor(block_tables, "block_tables", (num_seqs, None), (torch.int32,), device)
    check_tensor(context_lens, "context_lens", (num_seqs,), INDEX_DTYPES, device)
    max_context = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = partition_size_for(num_seqs, num_kv_heads, max_context,
                                            multiprocessors(device))
    check(partition_size >= 16 and partition_size & (partition_size - 1) == 0,
          f"partition_size must be a power of two >= 16, got {partition_size}")
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=dtype, device=device)  # [B, H, Dh]
    if num_seqs == 0:
        return out
    num_partitions = max(1, triton.cdiv(max_context, partition_size))
    split = num_partitions > 1
    part_shape = (num_seqs, num_heads, num_partitions) if split else (1, 1, 1)
    part_out = torch.empty(*part_shape, head_dim, dtype=torch.float32, device=device)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=device)
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_max, part_sum,
        scale * _LOG2E, block_size, num_partitions, window, q.stride(0), q.stride(1),
        out.stride(0),
        out.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION_SIZE=partition_size,
        BLOCK_N=min(partition_size, 16 if interpreting() else 64), SPLIT=split,
        DOT_FP32=dtype == torch.float32 or interpreting())
    if split:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_max, part_sum, context_lens, out, num_partitions, out.stride(0),
            out.stride(1), PARTITION_SIZE=partition_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_P=triton.next_power_of_2(num_partitions))
    return out


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                     v_cache: torch.Tensor, block_tables: torch.Tensor,
                                     context_lens: torch.Tensor, scale: float,
                                     window: int = 0) -> torch.Tensor:
    """Gather each sequence's context and softmax in float32, one sequence at a time."""
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for b, context_len in enumerate(context_lens.tolist()):
        j = torch.arange(max(0, context_len - window) if window else 0, context_len,
                         device=q.device)
        slots = block_tables[b, j // block_size].long() * block_size + j % block_size
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)  # [L, H, Dh]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, 1)
        probs = (torch.einsum("hd,lhd->hl", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v).to(q.dtype)
    return out

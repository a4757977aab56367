"""Rotary embedding on Q and K, fused with writing K and V into the paged cache.

Reads the fused projection `qkv [T, (H + 2 Hkv) * Dh]` once. With half = Dh / 2 and the HF
rotate_half layout (cos/sin rows are [freqs, freqs]), for each head of Q and K at position p:

    out[d]        = x[d] * cos[p, d]               - x[d + half] * sin[p, d]
    out[d + half] = x[d + half] * cos[p, d + half] + x[d] * sin[p, d + half]

Each product and the sum round to the input dtype as eager torch does. Rotated Q goes to a
new [T, H, Dh] tensor; rotated K and plain V go to cache slot `slot_mapping[t]` (a negative
slot means "do not store"), so the step's K/V never exist as separate tensors.
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
    rows_per_program,
)
from llmbus.services.executor.kernels.triton._rounding import to_dtype


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 -> dtype -> float32: where eager torch rounds an intermediate."""
    return to_dtype(x, dtype).to(tl.float32)


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, positions_ptr, slot_mapping_ptr, q_out_ptr, k_cache_ptr,
    v_cache_ptr, num_tokens, stride_qkv, stride_cos, stride_sin, stride_q_t, stride_q_h,
    stride_cache_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_POSITIONS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1)  # Q heads, then K heads (the same rotation)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    token_mask = tokens < num_tokens
    tokens = tokens.to(tl.int64)
    half = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_HALF)  # [BH]
    mask = token_mask[:, None] & (d[None, :] < half)  # [BT, BH]
    if HAS_POSITIONS:
        rows = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    else:
        rows = tokens
    cos_row = cos_ptr + rows[:, None] * stride_cos + d[None, :]
    sin_row = sin_ptr + rows[:, None] * stride_sin + d[None, :]
    cos1 = tl.load(cos_row, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + half, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + half, mask=mask, other=0.0).to(tl.float32)
    x_row = qkv_ptr + tokens[:, None] * stride_qkv + head * HEAD_DIM + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
    out1 = to_dtype(_round(x1 * cos1, dtype) + _round(-x2 * sin1, dtype), dtype)
    out2 = to_dtype(_round(x2 * cos2, dtype) + _round(x1 * sin2, dtype), dtype)
    if head < NUM_HEADS:
        q_row = q_out_ptr + tokens[:, None] * stride_q_t + head * stride_q_h + d[None, :]
        tl.store(q_row, out1, mask=mask)
        tl.store(q_row + half, out2, mask=mask)
    else:
        kv_head = head - NUM_HEADS
        slots = tl.load(slot_mapping_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)
        slot_mask = mask & (slots[:, None] >= 0)
        offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]
        tl.store(k_cache_ptr + offsets, out1, mask=slot_mask)
        tl.store(k_cache_ptr + offsets + half, out2, mask=slot_mask)
        # V rides along in the K programs: same slot, no rotation.
        v_row = x_row + NUM_KV_HEADS * HEAD_DIM
        tl.store(v_cache_ptr + offsets, tl.load(v_row, mask=slot_mask), mask=slot_mask)
        tl.store(v_cache_ptr + offsets + half, tl.load(v_row + half, mask=slot_mask),
                 mask=slot_mask)


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * Dh] -> rotated q [T, H, Dh]; writes K/V into the caches.

    cos/sin are the [max_pos, Dh] tables read at `positions [T]`, or, with positions None,
    already one row per token ([T, Dh]). Caches [num_blocks, block_size, Hkv, Dh];
    slot_mapping [T]. Grid: (cdiv(T, BLOCK_T), H + Hkv), one head of BLOCK_T tokens each.
    """
    device, dtype = qkv.device, qkv.dtype
    check_device(device)
    check_tensor(qkv, "qkv", (None, None), FLOAT_DTYPES, device)
    check_cache(k_cache, v_cache, dtype, device)
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    check(qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim,
          f"qkv width {qkv.shape[1]} != (H {num_heads} + 2 Hkv {num_kv_heads}) * Dh {head_dim}")
    rows = None if positions is None else cos.shape[0]
    if positions is None:
        check(cos.shape[0] == num_tokens, "without positions cos/sin need one row per token")
    else:
        check_tensor(positions, "positions", (num_tokens,), INDEX_DTYPES, device)
    check_tensor(cos, "cos", (rows, head_dim), (dtype,), device)
    check_tensor(sin, "sin", (rows, head_dim), (dtype,), device)
    check_tensor(slot_mapping, "slot_mapping", (num_tokens,), INDEX_DTYPES, device)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=device)  # [T, H, Dh]
    if num_tokens == 0:
        return q
    block_t = rows_per_program(num_tokens, on_gpu=16)
    grid = (triton.cdiv(num_tokens, block_t), num_heads + num_kv_heads)
    _rope_kv_kernel[grid](
        qkv, cos, sin, positions if positions is not None else slot_mapping, slot_mapping, q,
        k_cache, v_cache, num_tokens, qkv.stride(0), cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), HAS_POSITIONS=positions is not None,
        BLOCK_T=block_t)
    return q


def rope_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of model.py: apply_rope on Q and K, then write_kv."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if positions is not None:
        cos, sin = cos[positions], sin[positions]  # [T, Dh]
    x = qkv.view(num_tokens, -1, head_dim)  # [T, H + 2 Hkv, Dh]
    qk = x[:, :num_heads + num_kv_heads]
    half = head_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = qk * cos[:, None] + rotated * sin[:, None]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = qk[keep, num_heads:]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = x[keep, num_heads + num_kv_heads:]
    return qk[:, :num_heads].contiguous()

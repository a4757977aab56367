"""RoPE on Q/K fused with the paged K/V write, against the torch path (attention/torch_paged.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from llmbus.services.executor.kernels.triton.rope_kv import rope_kv, rope_kv_reference  # noqa: E402
from tests.executor.kernels.triton.helpers import (  # noqa: E402
    DEVICE,
    DTYPES,
    assert_close,
    gpu,
    paged_cache,
    requires_cuda,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 12


def rope_tables(head_dim: int, max_positions: int, dtype: torch.dtype, theta: float = 1e5):
    """As model.rope_tables: [max_positions, Dh] each, HF rotate_half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def _case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2 * torch.randn(num_tokens, width, generator=g)).to(dtype).to(DEVICE)
    positions = torch.randint(0, 200, (num_tokens,), generator=g).to(DEVICE)
    # distinct shuffled slots outside the null block
    slots = (torch.randperm((NUM_BLOCKS - 1) * BLOCK_SIZE, generator=g)[:num_tokens]
             + BLOCK_SIZE).to(DEVICE)
    return qkv, positions, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(3, 3, 64), (9, 3, 64), (4, 2, 16), (2, 1, 40)],
                         ids=lambda h: "H{}-Hkv{}-Dh{}".format(*h))
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_rope_kv_matches_reference(dtype, heads, num_tokens):
    num_heads, num_kv_heads, head_dim = heads
    qkv, positions, slots = _case(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    cos, sin = rope_tables(head_dim, 256, dtype)
    k_cache, v_cache = paged_cache(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q = rope_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads, positions=positions)
    q_expected = rope_kv_reference(qkv, cos, sin, k_expected, v_expected, slots, num_heads,
                                   positions=positions)
    assert q.shape == (num_tokens, num_heads, head_dim)
    assert_close(q, q_expected)
    assert_close(k_cache, k_expected)  # untouched slots compare too: nothing else written
    assert torch.equal(v_cache, v_expected)  # V is a plain copy


def test_per_token_rows_and_skipped_slots():
    """cos/sin already gathered per token (what backends/torch_llama.py passes); slot -1 stores
    nothing."""
    qkv, positions, slots = _case(6, 9, 3, 64, torch.float32, seed=3)
    slots[2] = -1
    cos, sin = rope_tables(64, 256, torch.float32)
    k_cache, v_cache = paged_cache(NUM_BLOCKS, BLOCK_SIZE, 3, 64, torch.float32)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q = rope_kv(qkv, cos[positions], sin[positions], k_cache, v_cache, slots, 9)
    q_expected = rope_kv_reference(qkv, cos, sin, k_expected, v_expected, slots, 9,
                                   positions=positions)
    assert_close(q, q_expected)
    # K is rotated (a fused multiply-add on a GPU rounds once where torch rounds twice), so it
    # is close; V is a plain copy, so it is equal. Untouched slots compare too: -1 wrote nothing.
    assert_close(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_launcher_rejects_bad_arguments():
    qkv, positions, slots = _case(4, 3, 3, 64, torch.float32)
    cos, sin = rope_tables(64, 256, torch.float32)
    k_cache, v_cache = paged_cache(NUM_BLOCKS, BLOCK_SIZE, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="qkv width"):
        rope_kv(qkv, cos, sin, k_cache, v_cache, slots, 4, positions=positions)
    with pytest.raises(ValueError, match="k_cache: dtype"):
        rope_kv(qkv, cos, sin, k_cache.half(), v_cache.half(), slots, 3, positions=positions)
    with pytest.raises(ValueError, match="one row per token"):
        rope_kv(qkv, cos, sin, k_cache, v_cache, slots, 3)
    with pytest.raises(ValueError, match="slot_mapping: axis 0"):
        rope_kv(qkv, cos, sin, k_cache, v_cache, slots[:2], 3, positions=positions)
    with pytest.raises(ValueError, match="contiguous"):
        rope_kv(qkv, cos, sin, k_cache.transpose(0, 1), v_cache.transpose(0, 1), slots, 3,
                positions=positions)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_many_tokens_on_gpu(dtype):
    num_tokens, num_heads, num_kv_heads, head_dim = 2048, 32, 8, 128
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    qkv = qkv.to(dtype).to(DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(DEVICE)
    cos, sin = rope_tables(head_dim, 4096, dtype)
    k_cache, v_cache = paged_cache(200, 16, num_kv_heads, head_dim, dtype)
    slots = (torch.randperm(199 * 16, generator=g)[:num_tokens] + 16).to(DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q = rope_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads, positions=positions)
    assert_close(q, rope_kv_reference(qkv, cos, sin, k_expected, v_expected, slots, num_heads,
                                      positions=positions))
    assert_close(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)

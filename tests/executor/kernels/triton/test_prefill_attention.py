"""Causal prefill attention over paged KV (cached prefixes, chunks, mixed batches)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from llmbus.services.executor.kernels.triton.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_reference,
)
from tests.executor.kernels.triton.helpers import (  # noqa: E402
    ATTENTION_TOLERANCES,
    DEVICE,
    DTYPES,
    assert_close,
    gpu,
    paged_cache,
    requires_cuda,
    shuffled_block_tables,
)


def _run(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
         num_blocks=48, seed=0):
    k_cache, v_cache = paged_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed)
    block_tables = shuffled_block_tables(context_lens, block_size, num_blocks, seed)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                device=DEVICE)
    lens = torch.tensor(context_lens, device=DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens,
                            max(query_lens), scale)
    expected = prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                           lens, scale)
    assert_close(out, expected, ATTENTION_TOLERANCES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(3, 3), (9, 3)], ids=["H3-Hkv3", "H9-Hkv3"])
def test_mixed_batch_matches_reference(dtype, heads):
    """A fresh prompt, a chunk after a cached prefix, and a decode token in one batch."""
    _run([19, 6, 1], [19, 23, 10], *heads, head_dim=64, block_size=4, dtype=dtype)


@pytest.mark.parametrize("case", [
    ([1], [1]),  # a single token, batch of 1
    ([37], [37]),  # one prompt longer than a query tile, not a multiple of the block size
    ([5, 5], [45, 5]),  # a chunk deep into a cached prefix
    ([3, 1, 17, 2], [3, 30, 20, 9]),
], ids=["single-token", "one-prompt", "cached-prefix", "batch-4"])
def test_shapes(case):
    _run(*case, 4, 2, 16, block_size=8, dtype=torch.float32, seed=3)


def test_launcher_rejects_bad_arguments():
    k_cache, v_cache = paged_cache(8, 4, 2, 16, torch.float32)
    q = torch.randn(5, 4, 16, device=DEVICE)
    tables = torch.ones(2, 3, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 2, 5], device=DEVICE)
    lens = torch.tensor([3, 5], device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_q: axis 0"):
        prefill_attention(q, k_cache, v_cache, tables, cu[:2], lens, 3, 0.25)
    with pytest.raises(ValueError, match="q: dtype"):
        prefill_attention(q.long(), k_cache, v_cache, tables, cu, lens, 3, 0.25)
    with pytest.raises(ValueError, match="k_cache is on|expected 4 dims"):
        prefill_attention(q, k_cache[0], v_cache[0], tables, cu, lens, 3, 0.25)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_chunks_on_gpu(dtype):
    _run([1024, 1, 300, 2048], [3000, 77, 300, 2048], 32, 8, 128, block_size=16, dtype=dtype,
         num_blocks=500)


@pytest.mark.parametrize("window", [1, 3, 8, 100], ids=lambda w: f"window-{w}")
def test_sliding_window(window):
    """Each query attends to its last `window` positions: a tile's later rows see none of the
    first keys it reads, a chunk behind a cached prefix starts inside it."""
    query_lens, context_lens = [37, 5, 1], [37, 45, 9]
    k_cache, v_cache = paged_cache(48, 8, 2, 16, torch.float32, 6)
    block_tables = shuffled_block_tables(context_lens, 8, 48, 6)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                device=DEVICE)
    lens = torch.tensor(context_lens, device=DEVICE)
    q = torch.randn(sum(query_lens), 4, 16, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    out = prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens,
                            max(query_lens), 0.25, window=window)
    expected = prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                           lens, 0.25, window=window)
    assert_close(out, expected, ATTENTION_TOLERANCES)
    assert not torch.isnan(out).any()

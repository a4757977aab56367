"""Split-K paged decode attention against a per-sequence float32 softmax."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from llmbus.services.executor.kernels.triton.paged_decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
    partition_size_for,
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


def _run(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, partition_size,
         num_blocks=48, pad=0, seed=0):
    k_cache, v_cache = paged_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed)
    block_tables = shuffled_block_tables(context_lens, block_size, num_blocks, seed, pad=pad)
    lens = torch.tensor(context_lens, device=DEVICE)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                 partition_size=partition_size)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, lens, scale)
    assert_close(out, expected, ATTENTION_TOLERANCES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(3, 3), (9, 3)], ids=["H3-Hkv3", "H9-Hkv3"])
@pytest.mark.parametrize("partition_size", [512, 16, None], ids=["one-pass", "split-k", "auto"])
def test_decode_matches_reference(dtype, heads, partition_size):
    # lengths off the block size; a single token; shuffled, non-contiguous blocks
    _run([37, 1, 16], *heads, head_dim=64, block_size=4, dtype=dtype,
         partition_size=partition_size)


def test_partition_size_fills_the_device_as_coarsely_as_it_can():
    """Grid programs = sequences x KV heads x partitions; the rule wants 2 per SM."""
    h200 = 132  # SMs: 264 programs wanted
    assert partition_size_for(1, 3, 4096, h200) == 32  # 3 x 128 = 384; at 64: 192, too few
    assert partition_size_for(16, 3, 1024, h200) == 128  # 16 x 3 x 8 = 384; at 256: 192
    assert partition_size_for(64, 3, 2048, h200) == 512  # 64 x 3 x 4 = 768 already
    assert partition_size_for(1, 1, 16, h200) == 32  # nothing to split: the smallest
    assert partition_size_for(1, 1, 4096, 1) == 512  # the interpreter: one program at a time


@pytest.mark.parametrize("context_lens", [[1], [50], [3, 29, 64, 5, 17]],
                         ids=["one-token", "batch-1", "batch-5"])
def test_decode_batches_and_padded_tables(context_lens):
    """Padding columns in the block table give partitions past every context: they are empty."""
    _run(context_lens, 4, 2, 16, block_size=8, dtype=torch.float32, partition_size=16,
         num_blocks=40, pad=3, seed=2)


def test_decode_head_dim_not_a_power_of_two():
    _run([21, 9], 6, 2, 40, block_size=4, dtype=torch.float16, partition_size=16)


def test_launcher_rejects_bad_arguments():
    k_cache, v_cache = paged_cache(8, 4, 2, 16, torch.float32)
    q = torch.randn(2, 4, 16, device=DEVICE)
    tables = torch.ones(2, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3, 5], device=DEVICE)
    with pytest.raises(ValueError, match="block_tables: dtype"):
        paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.25)
    with pytest.raises(ValueError, match="query heads over"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :8], k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="context_lens: axis 0"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens[:1], 0.25)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, partition_size=24)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_context_on_gpu(dtype):
    _run([4096, 1, 3000, 777, 2048, 4095, 16, 1234], 32, 8, 128, block_size=16, dtype=dtype,
         partition_size=512, num_blocks=1400)


@pytest.mark.parametrize("window", [1, 5, 20, 100], ids=lambda w: f"window-{w}")
@pytest.mark.parametrize("partition_size", [512, 16], ids=["one-pass", "split-k"])
def test_decode_sliding_window(window, partition_size):
    """Each sequence attends to its last `window` positions: partitions before them stay
    empty (split-k), a window wider than the context is the whole context."""
    k_cache, v_cache = paged_cache(48, 4, 2, 32, torch.float32, 4)
    lens = [37, 1, 16, 50]
    block_tables = shuffled_block_tables(lens, 4, 48, 4)
    context_lens = torch.tensor(lens, device=DEVICE)
    q = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.2,
                                 partition_size=partition_size, window=window)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, block_tables,
                                                context_lens, 0.2, window=window)
    assert_close(out, expected, ATTENTION_TOLERANCES)
    if window < 37:  # the window changes the answer: it is not the whole context's
        whole = paged_decode_attention_reference(q, k_cache, v_cache, block_tables,
                                                 context_lens, 0.2)
        assert (whole[0] - expected[0]).abs().max() > 1e-3

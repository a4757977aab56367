"""The C++ paged attention (kernels/cpu/paged_attention.cpp) against its torch reference
(`TorchOps.rope_write_kv` then `TorchOps.attention`), for every ISA build this CPU can run:
an AVX-512 machine also checks the AVX2 build that AVX2-only machines get."""

from __future__ import annotations

import pytest
import torch

from llmbus.services.executor.attention import cpu_paged as paged_attention
from llmbus.services.executor.attention.cpu_paged import PagedAttention
from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backends.torch_llama import TorchOps
from llmbus.services.executor.kernels.cpu.library import load_library
from tests.cpu_isas import ISAS

# (atol, rtol) against the float32 reference; float16 caches round K and V
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (5e-3, 5e-3)}


def _case(query_lens, context_lens, *, num_heads, num_kv_heads, head_dim, block_size,
          shared_blocks=0, seed=0):
    """Random qkv, rotary rows and a cache whose blocks are scattered (shuffled block ids);
    every sequence's first `shared_blocks` blocks are the same ones (a cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) - shared_blocks for c in context_lens]
    num_blocks = sum(blocks_per_seq) + shared_blocks + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    prefix, ids = ids[:shared_blocks], ids[shared_blocks:]
    tables = []
    for n in blocks_per_seq:
        tables.append(prefix + ids[:n])
        ids = ids[n:]
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size)
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 6
    emb = torch.cat([angles, angles], dim=-1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return meta, qkv, emb.cos(), emb.sin(), caches


CASES = {  # (query_lens, context_lens, heads, kv heads, head dim, block size, shared blocks,
           #  [sliding window])
    "one decode": ([1], [1], 4, 2, 16, 4, 0),
    "decodes of mixed lengths": ([1, 1, 1, 1], [5, 17, 64, 3], 9, 3, 64, 16, 0),
    "decodes beside prefill chunks": ([1, 7, 1, 12], [33, 7, 40, 30], 8, 2, 32, 4, 0),
    "no GQA, odd sizes": ([1, 1, 5], [131, 2, 9], 6, 6, 48, 8, 0),
    "long context": ([1, 1], [1030, 517], 9, 3, 64, 16, 0),
    "head dim 128, wide group": ([1, 3], [70, 70], 16, 2, 128, 16, 0),
    # a float16 cache's rows are widened a few heads per sweep, as many as the scratch holds:
    # at head size 256, the three KV heads of a decode's work item in sweeps of 2 and 1
    "head dim 256, heads widened in two sweeps": ([1] * 4, [70, 33, 100, 16], 6, 3, 256, 16, 0),
    # prefill chunks longer than one tile of rows and one span of keys: a fresh prompt, and a
    # chunk behind cached context, beside a decode
    "long chunks": ([70, 1, 41], [70, 90, 133], 9, 3, 64, 16, 0),
    "long chunks, no GQA, runtime head size": ([53, 20], [53, 77], 4, 4, 48, 8, 0),
    # decodes behind a shared prefix long enough to attend over together (cascade): more of
    # them than one group of rows, beside a prefill chunk over the same prefix
    "decodes sharing a long prefix": ([1] * 20 + [5], [100 + 3 * i for i in range(20)] + [90],
                                      9, 3, 64, 16, 5),
    # a prefix of 9 1/4 key spans cut into 4 uneven key ranges (one group of members, one KV
    # head), a member whose own part is its query alone, a chunk behind the same prefix
    "decodes behind a prefix in key ranges": ([1] * 4 + [3], [600, 610, 620, 593, 595],
                                              8, 1, 64, 16, 37),
    # a member whose own part is its query alone; no GQA, a runtime head size
    "shared prefix, own part one key": ([1, 1, 1], [73, 80, 100], 4, 4, 48, 8, 9),
    # blocks bigger than a softmax span (64 and 48 tokens), with a shared prefix and a chunk
    "big blocks": ([1, 1, 1, 9], [200, 150, 64, 100], 8, 2, 64, 64, 1),
    "48-token blocks": ([1, 1, 20], [100, 97, 140], 9, 3, 32, 48, 2),
    # more decodes than one team of 8, all behind a 4-block prefix, one of them a prefill
    "shared prefix": ([1] * 10 + [6], [33, 40, 47, 35, 64, 38, 33, 41, 50, 39, 37],
                      9, 3, 64, 8, 4),
    # Sliding windows (Gemma 3's local layers): decodes whose window starts mid-block, is
    # block-aligned, or is longer than the context; prefill chunks whose rows' windows begin
    # in different spans (one row of a tile sees none of a span another row sees); decodes
    # behind a shared prefix (shared no more: each starts at its own window); head size 256.
    "window, decodes": ([1, 1, 1, 1], [100, 64, 5, 1030], 8, 2, 64, 16, 0, 20),
    "window, block-aligned start": ([1, 1], [48, 49], 4, 2, 32, 16, 0, 32),
    "window, prefill chunks": ([70, 1, 41, 130], [70, 90, 133, 300], 9, 3, 64, 16, 0, 37),
    "window, short, no GQA": ([9, 1], [9, 40], 4, 4, 48, 8, 0, 3),
    "window, shared prefix": ([1] * 6 + [5], [100 + 3 * i for i in range(6)] + [90],
                              9, 3, 64, 16, 5, 24),
    "window, head size 256": ([1, 7], [300, 50], 4, 1, 256, 16, 0, 17),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_torch_reference(isa, kv_dtype, case):
    query_lens, context_lens, heads, kv_heads, head_dim, block_size, shared, *window = case
    window = window[0] if window else 0
    lib = load_library(isa)
    if lib is None:
        pytest.skip("no C++ compiler here")
    meta, qkv, cos, sin, (k, v) = _case(query_lens, context_lens, num_heads=heads,
                                        num_kv_heads=kv_heads, head_dim=head_dim,
                                        block_size=block_size, shared_blocks=shared)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    k_ref, v_ref = k.float(), v.float()
    q_ref = TorchOps.rope_write_kv(qkv, cos, sin, k_ref, v_ref, meta.slot_mapping, heads)
    expected = TorchOps.attention(q_ref, k_ref, v_ref, meta, head_dim ** -0.5, window)

    out = PagedAttention(lib, num_threads=2)(qkv, cos, sin, k, v, meta, heads, head_dim ** -0.5,
                                             window)
    atol, rtol = TOLERANCES[kv_dtype]
    # the cache got the roped K and V of every token, rounded to its dtype
    torch.testing.assert_close(k.float(), k_ref.to(kv_dtype).float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(v.float(), v_ref.to(kv_dtype).float(), atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


def test_rejects_what_it_cannot_run():
    lib = load_library()
    if lib is None:
        pytest.skip("no C++ compiler here")
    meta, qkv, cos, sin, (k, v) = _case([1], [4], num_heads=4, num_kv_heads=2, head_dim=16,
                                        block_size=4)
    attention = PagedAttention(lib, num_threads=1)
    with pytest.raises(ValueError, match="does not fit"):
        attention(qkv, cos, sin, k, v, meta, 3, 0.25)  # 3 query heads: qkv is 4 + 2 x 2 wide
    with pytest.raises(ValueError, match="float32/float16 cache"):
        attention(qkv, cos, sin, k.bfloat16(), v.bfloat16(), meta, 4, 0.25)


def test_chunks_longer_than_the_kernel_takes_go_to_sdpa(monkeypatch):
    """Prefill chunks past KERNEL_MAX_QUERY_LEN get the kernel's RoPE and KV write, then torch
    SDPA; decodes beside them stay in the kernel."""
    lib = load_library()
    if lib is None:
        pytest.skip("no C++ compiler here")
    monkeypatch.setattr(paged_attention, "KERNEL_MAX_QUERY_LEN", 4)
    query_lens, context_lens = [1, 7, 1, 12, 3], [33, 7, 40, 30, 20]
    meta, qkv, cos, sin, (k, v) = _case(query_lens, context_lens, num_heads=8, num_kv_heads=2,
                                        head_dim=32, block_size=4)
    k_ref, v_ref = k.clone(), v.clone()
    q_ref = TorchOps.rope_write_kv(qkv, cos, sin, k_ref, v_ref, meta.slot_mapping, 8)
    expected = TorchOps.attention(q_ref, k_ref, v_ref, meta, 32 ** -0.5)
    out = PagedAttention(lib, num_threads=2)(qkv, cos, sin, k, v, meta, 8, 32 ** -0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)

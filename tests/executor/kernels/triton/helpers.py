"""Shared by the kernel tests: device, tolerances, paged KV caches with shuffled blocks."""

from __future__ import annotations

import random

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

# (atol, rtol) per dtype. bfloat16 runs under the interpreter too: its loads and stores are
# exact, and the kernels cast bf16 tiles to float32 before tl.dot there.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# Attention and softmax sums in another order, and half-precision P @ V on a GPU.
ATTENTION_TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, table=TOLERANCES) -> None:
    atol, rtol = table[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def paged_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V caches [num_blocks, block_size, Hkv, Dh]; block 0 is the null block."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    k[0], v[0] = 0, 0
    return k.to(DEVICE), v.to(DEVICE)


def shuffled_block_tables(context_lens: list[int], block_size: int, num_blocks: int,
                          seed: int = 0, pad: int = 0) -> torch.Tensor:
    """Disjoint, shuffled block ids per sequence; [B, max_blocks (+ pad)] int32, 0-padded."""
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    needed = [-(-n // block_size) for n in context_lens]
    width = max(needed) + pad
    assert sum(needed) <= len(free), "not enough blocks"
    rows = []
    for n in needed:
        rows.append([free.pop() for _ in range(n)] + [0] * (width - n))
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)

"""LlamaModel.forward with the Triton backend forced on equals the torch backend.

On a machine without a GPU this is the only run of the model's CUDA path: the same forward,
each op a Triton kernel under the interpreter.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from llmbus.services.executor.attention.metadata import build_attention_metadata  # noqa: E402
from llmbus.services.executor.backends.torch_llama import LlamaModel, TorchOps, select_ops  # noqa: E402
from llmbus.services.executor.kernels.triton.ops import TritonOps  # noqa: E402
from llmbus.services.executor.kv_cache import KVCache  # noqa: E402
from llmbus.services.executor.weights.gguf_loader import load_gguf  # noqa: E402
from tests.executor.kernels.triton.helpers import DEVICE  # noqa: E402
from tests.gguf_fixtures import TinySpec, write_tiny_llama  # noqa: E402

BLOCK_SIZE = 4
# Three requests through three steps: prompts in chunks (one with a cached prefix by the second
# step), then a mixed step, then a decode-only step (the split-K decode kernel).
# (query_lens, context_lens); block tables are fixed, shuffled, non-contiguous.
STEPS = [([6, 3, 9], [6, 3, 9]), ([5, 1, 1], [11, 4, 10]), ([1, 1, 1], [12, 5, 11])]
BLOCK_TABLES = [[7, 2, 11], [5, 9], [1, 12, 4]]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(tmp_path_factory, request):
    """A tiny llama, and a tiny Gemma 3 whose two layers slide a window of 4 (shorter than
    every context but one) with their own RoPE base, GeGLU and post-norms."""
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    spec = TinySpec() if request.param == "llama" else TinySpec(sliding_window=4, tied=True)
    write_tiny_llama(path, spec, arch=request.param)
    return load_gguf(path)[:2]


def test_backend_is_chosen_by_device():
    assert select_ops(None, torch.device("cpu")) is TorchOps
    assert select_ops(None, torch.device("cuda")) is TritonOps
    assert select_ops("triton", torch.device("cpu")) is TritonOps
    with pytest.raises(ValueError, match="unknown kernels"):
        select_ops("cuda", torch.device("cpu"))


# bfloat16 keeps 8 bits of mantissa: a logit of |x| may round one ulp (|x| / 128) apart
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 0.0),
                                             (torch.bfloat16, 0.25, 2 ** -7)],
                         ids=["fp32", "bf16"])
def test_triton_forward_matches_torch(tiny, dtype, atol, rtol):
    config, weights = tiny
    results = {}
    for kernels in ("torch", "triton"):
        model = LlamaModel(config, weights, max_positions=64, dtype=dtype, device=DEVICE,
                           kernels=kernels)
        assert model.ops.name == kernels
        cache = KVCache(config, 16, BLOCK_SIZE, dtype, DEVICE)
        token_ids = torch.arange(3, 3 + 12 * 3).view(3, 12) % config.vocab_size
        logits = []
        for query_lens, context_lens in STEPS:
            meta = build_attention_metadata(query_lens, context_lens, BLOCK_TABLES, BLOCK_SIZE,
                                            DEVICE)
            ids = torch.cat([token_ids[b, c - q:c] for b, (q, c)
                             in enumerate(zip(query_lens, context_lens, strict=True))])
            last = meta.cu_seqlens_q[1:] - 1  # [B] each sequence's last token
            logits.append(model.forward(ids.to(DEVICE), meta.positions, meta, cache, last))
        results[kernels] = logits, cache
    (torch_logits, torch_cache), (triton_logits, triton_cache) = results.values()
    for expected, actual in zip(torch_logits, triton_logits, strict=True):
        assert actual.shape == expected.shape == (3, config.vocab_size)
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
        if dtype == torch.float32:  # bf16 logits may swap near-ties
            assert actual.argmax(-1).tolist() == expected.argmax(-1).tolist()
    cache_tol = (1e-5, 1e-5) if dtype == torch.float32 else (0.1, 0.02)
    torch.testing.assert_close(triton_cache.k, torch_cache.k, atol=cache_tol[0],
                               rtol=cache_tol[1])
    torch.testing.assert_close(triton_cache.v, torch_cache.v, atol=cache_tol[0],
                               rtol=cache_tol[1])

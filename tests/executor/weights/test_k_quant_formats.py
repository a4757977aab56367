"""Every K-quant and IQ4 format at the file's bits (weights/k_quants.py): one tiny llama file
holding Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS matrices (as Q2_K and Q3_K_M files mix
them) loads with no dense copy of any of them; `--exact` equals transformers (which
dequantizes through gguf-py), and the fast mode's integer kernel scores a text of the model's
own within 1% of the exact mode's perplexity (design invariant 3)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backends.cpu_llama import CpuLlamaModel
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.perplexity import perplexity
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.k_quants import KQuantWeight
from llmbus.services.executor.weights.matrices import matrix_types
from tests.executor.own_text import BLOCKS, NUM_TOKENS, sampled_text
from tests.gguf_fixtures import TinySpec, write_tiny_llama

KINDS = gguf.GGMLQuantizationType
SPEC = TinySpec(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
EVERY_FORMAT = {"attn_q.weight": KINDS.Q2_K, "attn_k.weight": KINDS.Q3_K,
                "attn_v.weight": KINDS.Q5_K, "attn_output.weight": KINDS.IQ4_XS,
                "ffn_gate.weight": KINDS.IQ4_NL, "ffn_up.weight": KINDS.Q2_K,
                "ffn_down.weight": KINDS.Q3_K, "output.weight": KINDS.Q6_K}
# Random weights within about ±0.2: logits of a trained model's scale
# (|logit| < 20), so float32 rounding stays far below the 1e-4 asked.
SCALE = 0.2
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, SPEC.vocab_size, 24)]


@pytest.fixture(scope="module")
def every_format(tmp_path_factory):
    path = tmp_path_factory.mktemp("k-quants") / "every-format.gguf"
    write_tiny_llama(path, SPEC, seed=8, quantized="Q8_0", k_quants=EVERY_FORMAT,
                     k_quant_scale=SCALE)
    return path


def _logits(model, config) -> torch.Tensor:
    cache = KVCache(config, num_blocks=8, block_size=16, dtype=torch.float32)
    meta = build_attention_metadata([len(TOKENS)], [len(TOKENS)], [[1, 2]], 16)
    with torch.inference_mode():
        return model.forward(torch.tensor(TOKENS), meta.positions, meta, cache,
                             torch.arange(len(TOKENS)))


def test_every_format_loads_at_its_bits_with_no_dense_copy(every_format):
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(every_format)).tensors}
    assert {types[f"blk.0.{n}"] for n in EVERY_FORMAT if n != "output.weight"} == {
        "Q2_K", "Q3_K", "Q5_K", "IQ4_XS", "IQ4_NL"}
    assert matrix_types(every_format) == (  # the executor's start-up line says so
        "Q2_K 4, Q3_K 4, IQ4_NL 2, IQ4_XS 2, Q5_K 2, Q6_K 1, Q8_0 1")
    _, dense, native = load_gguf(every_format, keep_native=True, dense_for_native=False)
    for name in EVERY_FORMAT:
        full = name if name == "output.weight" else f"blk.0.{name}"
        assert isinstance(native[full], KQuantWeight) and full not in dense


def test_every_format_in_the_exact_mode_equals_transformers(every_format):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    config, dense, native = load_gguf(every_format, keep_native=True, dense_for_native=False,
                                      exact=True)
    got = _logits(CpuLlamaModel(config, dense, native, max_positions=64, exact=True), config)
    hf = AutoModelForCausalLM.from_pretrained(every_format.parent, gguf_file=every_format.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf(torch.tensor([TOKENS])).logits[0]
    assert want.abs().max() < 20
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))  # greedy, token for token


def test_every_format_in_the_fast_kernel_is_within_one_percent_of_exact_perplexity(
        every_format):
    config, dense, native = load_gguf(every_format, keep_native=True, dense_for_native=False,
                                      exact=True)
    exact = CpuLlamaModel(config, dense, native, max_positions=NUM_TOKENS, exact=True,
                          num_threads=2)
    text = sampled_text(exact, config)
    want = perplexity(exact, KVCache(config, BLOCKS + 1, 16, torch.float32), text, chunk_size=64)
    config, dense, native = load_gguf(every_format, keep_native=True, dense_for_native=False)
    fast = CpuLlamaModel(config, dense, native, max_positions=NUM_TOKENS, num_threads=2)
    if fast.int_step is None:
        pytest.skip("no C++ compiler: the integer kernel was not built")
    got = perplexity(fast, KVCache(config, BLOCKS + 1, 16, torch.float16), text, chunk_size=64)
    assert 2 < want < config.vocab_size / 4  # the text is the model's own, not noise
    assert abs(got / want - 1) < 0.01, (got, want)

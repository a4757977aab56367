"""Design invariant 3 for the new families: the fast mode's perplexity within 1% of the exact
mode's, on a text of the model's own (random weights have no English to be scored on: the exact
mode samples 300 tokens, then each mode scores them through its own forward and cache). qwen3
and qwen3moe run the integer kernel, gemma3 ONNX Runtime's int8 graphs (the kernel does not take
its layers), all with float16 KV; qwen3moe's exact mode is the torch backend."""

from __future__ import annotations

import pytest
import torch

from llmbus.services.executor.backends.cpu_llama import CpuLlamaModel
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.perplexity import perplexity
from llmbus.services.executor.weights.gguf_loader import load_gguf
from tests.executor.own_text import BLOCKS, NUM_TOKENS, sampled_text
from tests.gguf_fixtures import TinySpec, write_tiny_llama

FAMILIES = {
    "qwen3": TinySpec(head_size=128),
    # untied here: a tiny tied model all but repeats its input, which scores nothing
    "gemma3": TinySpec(num_layers=6, num_heads=2, num_kv_heads=1, head_size=256,
                       rope_theta=1e6, rms_norm_eps=1e-6, sliding_window=8),
    "qwen3moe": TinySpec(head_size=128, num_experts=8, num_experts_used=2, expert_size=96),
}
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_mode_perplexity_is_within_one_percent_of_exact(tmp_path, family):
    path = tmp_path / f"{family}.gguf"
    write_tiny_llama(path, FAMILIES[family], seed=11, arch=family, quantized="Q8_0")
    if FAMILIES[family].num_experts:  # the exact mode's backend for experts
        config, dense, _ = load_gguf(path)
        exact = LlamaModel(config, dense, max_positions=NUM_TOKENS)
    else:
        config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False,
                                          exact=True)
        exact = CpuLlamaModel(config, dense, native, max_positions=NUM_TOKENS, exact=True,
                              num_threads=2)
    text = sampled_text(exact, config)
    want = perplexity(exact, KVCache(config, BLOCKS + 1, 16, torch.float32), text,
                      chunk_size=64)
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    fast = CpuLlamaModel(config, dense, native, max_positions=NUM_TOKENS, num_threads=2)
    got = perplexity(fast, KVCache(config, BLOCKS + 1, 16, torch.float16), text, chunk_size=64)
    assert 2 < want < config.vocab_size / 4  # the text is the model's own, not noise
    assert abs(got / want - 1) < 0.01, (got, want)

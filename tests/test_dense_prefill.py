"""Big steps as bfloat16 GEMMs (services/executor/dense_prefill.py): the widening kernel
against torch's own float32 -> bfloat16 conversion of the dequantized weights, and the whole
path against the exact forward on the default model."""

from __future__ import annotations

import pytest
import torch

from llmbus.services.executor.cpu_kernels.library import load_library
from llmbus.services.executor.dense_prefill import DENSE_PREFILL_TOKENS, widen
from llmbus.services.executor.gguf_loader import load_gguf
from llmbus.services.executor.gguf_quants import Q4_1Weight, Q8_0Weight
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.model import build_attention_metadata
from llmbus.services.executor.onnx_model import ACCURACY_EXACT, ACCURACY_FAST, OnnxLlamaModel
from llmbus.services.executor.quant_parts import QuantPart
from llmbus.services.model_files import default_model_path
from tests.gguf_fixtures import TinySpec, write_tiny_llama

needs_compiler = pytest.mark.skipif(load_library() is None, reason="no C++ compiler here")


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between two bfloat16 tensors in units in the last place."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@needs_compiler
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_widening_matches_torch_conversion(kind):
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 256
    scales = torch.rand(n, k // 32, generator=gen).half().float() * 0.02
    if kind == "q8_0":
        weight = Q8_0Weight(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8),
                            scales)
    else:
        mins = (-8 * scales if kind == "q4_0"
                else (torch.randn(n, k // 32, generator=gen) * 0.05).half().float())
        weight = Q4_1Weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                            scales, mins)
    widened = widen(load_library(), [QuantPart.of(weight)],
                    torch.empty(n * k, dtype=torch.bfloat16), num_threads=2)
    expected = weight.dequantize().to(torch.bfloat16)
    # the kernel may fuse scale * code + min into one rounding, torch rounds twice
    assert _bf16_ulps(widened, expected) <= 1
    assert (widened == expected).float().mean() > 0.99


@pytest.mark.model
@needs_compiler
@pytest.mark.skipif(not default_model_path().is_file(), reason="default model not pulled")
def test_big_step_follows_the_exact_forward():
    config, dense, native = load_gguf(default_model_path(), keep_native=True,
                                      dense_for_native=False)
    num_tokens = DENSE_PREFILL_TOKENS + 40
    ids = torch.tensor([(i * 7919) % 20000 + 100 for i in range(num_tokens)])
    logits = {}
    for name, level, dense_prefill in (("exact", ACCURACY_EXACT, False),
                                       ("bfloat16", ACCURACY_FAST, True)):
        model = OnnxLlamaModel(config, dense, native, max_positions=num_tokens,
                               accuracy_level=level, num_threads=2, dense_prefill=dense_prefill)
        assert (model.dense_prefill is not None) == dense_prefill
        blocks = -(-num_tokens // 16)
        meta = build_attention_metadata([num_tokens], [num_tokens],
                                        [list(range(1, blocks + 1))], 16)
        logits[name] = model.forward(ids, torch.arange(num_tokens), meta,
                                     KVCache(config, blocks + 1, 16, torch.float32),
                                     torch.arange(num_tokens))
    exact, fast = logits["exact"], logits["bfloat16"]
    agree = (exact.argmax(-1) == fast.argmax(-1)).float().mean()
    cosine = torch.nn.functional.cosine_similarity(exact, fast, dim=-1).min()
    assert agree > 0.9 and cosine > 0.99, (float(agree), float(cosine))
    # only one layer's widened weights exist at a time: no dense twin of the model
    widest = max(sum(p.n for p in parts) * parts[0].k
                 for layer in model.dense_prefill.matrices for parts in layer.values())
    assert model.dense_prefill._buffer.numel() == widest
    assert all(isinstance(p, QuantPart) for layer in model.dense_prefill.matrices
               for parts in layer.values() for p in parts)


@needs_compiler
def test_float_files_keep_to_onnx_runtime(tmp_path):
    """A float32 file's matrices have no codes to widen: big steps stay in the graphs rather
    than keep a bfloat16 copy of every weight."""
    path = tmp_path / "tiny-f32.gguf"
    write_tiny_llama(path, TinySpec())
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    model = OnnxLlamaModel(config, dense, native, max_positions=16, num_threads=1,
                           dense_prefill=True)
    assert model.dense_prefill is None

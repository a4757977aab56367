"""K-quants (Q3_K, Q4_K, Q5_K, Q6_K: what most GGUF downloads are) and the Q5_0/Q5_1 that
Q4_K_M files mix in, kept quantized: Q4_K exactly in the Q4_1 form every quantized kernel
takes, Q5_0 exactly in the Q8_0 form, Q3_K and Q6_K in their own (k_quants.py), Q5_1 and Q5_K
requantized to Q8_0 within half a step in the fast mode only; no dense copy of them in memory;
a model of them against its dequantized reference, and in the exact mode against HF
transformers on the same file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backends.cpu_llama import CpuLlamaModel
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.gguf_quants import (
    parse_q4_k,
    parse_q5_0,
    requantize_q8_0,
)
from tests.executor.rounding_noise import assert_within_rounding_noise, draws, fast_mode_model
from tests.gguf_fixtures import TinySpec, random_k_quant, write_tiny_llama

KINDS = gguf.GGMLQuantizationType


def dequantized(raw: np.ndarray, kind, shape) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32).reshape(shape)


def test_q4_k_is_q4_1_exactly():
    raw = random_k_quant(KINDS.Q4_K, 16, 1024, seed=0)
    weight = parse_q4_k(raw, (16, 1024))
    assert weight.codes.max() <= 15
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantized(raw, KINDS.Q4_K,
                                                                         (16, 1024))))


def test_q5_0_is_q8_0_exactly():
    values = np.random.default_rng(5).standard_normal((16, 1024)).astype(np.float32)
    raw = gguf.quants.quantize(values, KINDS.Q5_0)
    weight = parse_q5_0(raw, (16, 1024))
    assert weight.codes.min() >= -16 and weight.codes.max() <= 15
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantized(raw, KINDS.Q5_0,
                                                                         (16, 1024))))


def _random_blocks(kind, rows: int, cols: int, seed: int) -> np.ndarray:
    if kind in (KINDS.Q5_0, KINDS.Q5_1):  # gguf-py quantizes these itself
        values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(values, kind)
    return random_k_quant(kind, rows, cols, seed=seed)


@pytest.mark.parametrize("kind", [KINDS.Q5_1, KINDS.Q5_K, KINDS.Q6_K], ids=lambda k: k.name)
def test_q5_1_q5_k_and_q6_k_requantize_within_half_a_step(kind):
    values = dequantized(_random_blocks(kind, 16, 1024, seed=1), kind, (16, 1024))
    weight = requantize_q8_0(values)
    step = weight.scales.repeat_interleave(32, dim=1)
    error = (weight.dequantize() - torch.from_numpy(values)).abs()
    assert (error <= step / 2 + 1e-7).all() and error.max() > 0


SPEC = TinySpec(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
TOKENS = [int(t) for t in np.random.default_rng(2).integers(3, SPEC.vocab_size, 24)]


def _forward(model, config, kv_dtype=torch.float32) -> torch.Tensor:
    cache = KVCache(config, num_blocks=8, block_size=16, dtype=kv_dtype)
    n = len(TOKENS)
    meta = build_attention_metadata([n], [n], [[1, 2]], 16)
    with torch.inference_mode():
        return model.forward(torch.tensor(TOKENS), meta.positions, meta, cache,
                             torch.arange(n))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per file: (path, logits of the model on its dequantized weights)."""
    files = {}
    for name, kinds in {"q4_k": {"weight": KINDS.Q4_K},
                        "q4_k_m": {"ffn_down.weight": KINDS.Q6_K, "output.weight": KINDS.Q6_K,
                                   "attn_v.weight": KINDS.Q5_K, "weight": KINDS.Q4_K}}.items():
        path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
        write_tiny_llama(path, SPEC, seed=4, k_quants=kinds)
        config, dense, _ = load_gguf(path)
        files[name] = path, _forward(LlamaModel(config, dense, max_positions=64), config)
    return files


def test_k_quant_matrices_load_without_a_dense_copy(reference):
    config, dense, native = load_gguf(reference["q4_k_m"][0], keep_native=True,
                                      dense_for_native=False)
    matrices = [n for n in native if n.startswith("blk.")]
    assert len(matrices) == 7 * SPEC.num_layers and not any(n in dense for n in matrices)
    assert "output.weight" in native and "token_embd.weight" in native


def test_a_q4_k_model_in_the_exact_graphs_is_its_dequantized_reference(reference):
    path, want = reference["q4_k"]
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    model = CpuLlamaModel(config, dense, native, max_positions=64, exact=True)
    torch.testing.assert_close(_forward(model, config), want, atol=1e-4, rtol=1e-4)


def test_a_mixed_k_quant_model_in_the_fast_kernel_stays_close(reference):
    path, want = reference["q4_k_m"]
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    model = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2)
    got = _forward(model, config, torch.float16)
    assert_within_rounding_noise(got, want, _dithered(path, graphs=model.int_step is None))


def _dithered(path, graphs: bool) -> torch.Tensor:
    """Draws of the fast mode's rounding, on its requantized weights (rounding_noise.py)."""
    model, noise = fast_mode_model(path, graphs=graphs, max_positions=64)
    return draws(model, lambda m: _forward(m, model.config), noise)


def test_requantizing_in_row_chunks_is_requantizing_whole():
    from llmbus.services.executor.weights.gguf_quants import REQUANTIZE_ROWS, native_parsers

    rows = 2 * REQUANTIZE_ROWS + 100
    raw = _random_blocks(KINDS.Q5_1, rows, 256, seed=3)
    chunked = native_parsers(gguf)[KINDS.Q5_1](raw, (rows, 256))
    whole = requantize_q8_0(dequantized(raw, KINDS.Q5_1, (rows, 256)))
    assert torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.scales, whole.scales)


@pytest.mark.parametrize("kind", [KINDS.Q2_K, KINDS.Q3_K, KINDS.Q5_K, KINDS.Q6_K, KINDS.IQ4_NL,
                                  KINDS.IQ4_XS], ids=lambda k: k.name)
def test_k_quants_parse_and_tile_in_row_chunks_as_whole(kind, monkeypatch):
    """The K-quants unpack and tile CHUNK_ROWS rows at a time (a vocabulary head's
    temporaries stay small): the values are gguf-py's, the tiles those of one chunk."""
    from llmbus.services.executor.weights import k_quants
    from llmbus.services.executor.weights.gguf_quants import native_parsers
    from llmbus.services.executor.weights.quant_parts import QuantPart

    rows = 2 * k_quants.CHUNK_ROWS + 16
    raw = random_k_quant(kind, rows, 256, seed=7)
    weight = native_parsers(gguf)[kind](raw, (rows, 256))
    assert torch.equal(weight.dequantize(),
                       torch.from_numpy(dequantized(raw, kind, (rows, 256))))
    chunked = QuantPart.of(weight)
    monkeypatch.setattr(k_quants, "CHUNK_ROWS", 4 * rows)
    whole = QuantPart.of(weight)
    for field in ("codes", "high_codes", "scales", "mins", "sub_scales", "sub_mins"):
        a, b = getattr(chunked, field), getattr(whole, field)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), field


def test_a_model_that_may_release_the_native_forms_keeps_only_the_embedding(reference):
    path, want = reference["q4_k_m"]
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    kept = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2)
    if kept.int_step is None:
        pytest.skip("no C++ compiler: the integer kernel was not built")
    released = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2,
                             release_native=True)
    assert set(native) == {"token_embd.weight"}  # tiled matrices left as they were tiled
    assert released.int_step is not None
    torch.testing.assert_close(_forward(released, config, torch.float16),
                               _forward(kept, config, torch.float16))


# As Q4_K_M and Q3_K_M files mix them: Q4_K, Q5_0 where rows are not multiples of 256 (here:
# every matrix left), Q6_K for ffn_down and the head, Q5_K, Q3_K, and a Q8_0 embedding. The
# K-quants' random weights are kept within ±0.1 (1/√256 is 0.06), so the logits have a trained
# model's scale (|logit| < 20) and float32 rounding stays far below the 1e-4 asked of them.
K_QUANT_SCALE = 0.1
MIXED = {"attn_q.weight": KINDS.Q4_K, "ffn_gate.weight": KINDS.Q4_K,
         "ffn_down.weight": KINDS.Q6_K, "output.weight": KINDS.Q6_K,
         "attn_v.weight": KINDS.Q5_K, "ffn_up.weight": KINDS.Q3_K}


def _hf_logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([TOKENS])).logits[0]


@pytest.mark.parametrize("rest", ["Q5_0", "Q5_1"])
def test_a_mixed_file_in_the_exact_mode_equals_transformers(tmp_path, rest):
    pytest.importorskip("transformers")
    path = tmp_path / f"mixed-{rest}.gguf"
    write_tiny_llama(path, SPEC, seed=6, quantized=rest, k_quants=MIXED,
                     k_quant_scale=K_QUANT_SCALE)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {types["blk.0.attn_k.weight"], types["blk.0.attn_q.weight"],
            types["blk.0.ffn_down.weight"], types["blk.0.ffn_up.weight"],
            types["token_embd.weight"]} == {rest, "Q4_K", "Q6_K", "Q3_K", "Q8_0"}
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False,
                                      exact=True)
    # Nothing requantized: what has no exact native form loads dense, with the file's values.
    assert "blk.0.ffn_down.weight" in dense and "blk.0.ffn_down.weight" not in native
    assert ("blk.0.attn_k.weight" in native) == (rest == "Q5_0")
    model = CpuLlamaModel(config, dense, native, max_positions=64, exact=True)
    got, want = _forward(model, config), _hf_logits(path)
    assert want.abs().max() < 20
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_mixed_file_in_the_fast_kernel_takes_every_type(tmp_path):
    path = tmp_path / "mixed-fast.gguf"
    write_tiny_llama(path, SPEC, seed=6, quantized="Q5_1", k_quants={
        **MIXED, "attn_k.weight": KINDS.Q5_0}, k_quant_scale=K_QUANT_SCALE)
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    assert not [n for n in native if n in dense]  # no dense copy of any quantized matrix
    exact = CpuLlamaModel(config, *load_gguf(path, keep_native=True, dense_for_native=False,
                                             exact=True)[1:], max_positions=64, exact=True)
    want = _forward(exact, config)
    assert {type(native[f"blk.0.{n}"]).__name__ for n in ("ffn_up.weight", "ffn_down.weight")
            } == {"KQuantWeight"}  # Q3_K and Q6_K at their own bits
    fast = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2)
    if fast.int_step is None:
        pytest.skip("no C++ compiler: the integer kernel was not built")
    got = _forward(fast, config, torch.float16)
    assert_within_rounding_noise(got, want, _dithered(path, graphs=False))


def test_a_mixed_file_in_onnx_runtime_graphs_takes_the_k_quants_requantized(tmp_path):
    """Where the integer kernel is not built, the fast mode's graphs take Q3_K and Q6_K as
    Q8_0 (no graph has 16-weight sub-blocks)."""
    path = tmp_path / "mixed-graphs.gguf"
    write_tiny_llama(path, SPEC, seed=6, quantized="Q5_0", k_quants=MIXED,
                     k_quant_scale=K_QUANT_SCALE)
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    exact = CpuLlamaModel(config, *load_gguf(path, keep_native=True, dense_for_native=False,
                                             exact=True)[1:], max_positions=64, exact=True)
    graphs = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2,
                           integer_kernel=False)
    got = _forward(graphs, config, torch.float16)
    assert_within_rounding_noise(got, _forward(exact, config), _dithered(path, graphs=True))

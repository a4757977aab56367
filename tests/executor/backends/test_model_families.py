"""GGUF families beyond llama, on tiny generated files compared with HF transformers loading the
same file: qwen2 (Q/K/V biases, Q/K rows in HF order) and qwen3 (a per-head RMSNorm of Q and
K, heads of 128 wider than hidden / heads) on the torch backend and on every CPU path (ONNX
Runtime's graphs in the exact mode, llmbus's integer kernel in the fast one)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backends.cpu_llama import CpuLlamaModel
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kernels.cpu.library import load_library
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.model_config import UnsupportedModelError
from tests.executor.rounding_noise import assert_within_rounding_noise, draws, fast_mode_model
from tests.gguf_fixtures import QWEN3_SPEC, TinySpec, write_tiny_llama
from tests.hf_reference import hf_from_gguf

pytest.importorskip("transformers")

SPEC = TinySpec()
TOKENS = [int(t) for t in np.random.default_rng(1).integers(3, SPEC.vocab_size, 40)]


def _hf_logits(path, family: str = "Qwen2") -> torch.Tensor:
    model = hf_from_gguf(path, family)
    with torch.inference_mode():
        return model(torch.tensor([TOKENS])).logits[0]


def _forward(model, config, kv_dtype=torch.float32) -> torch.Tensor:
    cache = KVCache(config, num_blocks=16, block_size=16, dtype=kv_dtype)
    n = len(TOKENS)
    meta = build_attention_metadata([n], [n], [list(range(1, 1 + -(-n // 16)))], 16)
    with torch.inference_mode():
        return model.forward(torch.tensor(TOKENS), meta.positions, meta, cache,
                             torch.arange(n))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2") / "tiny-qwen2.gguf"
    write_tiny_llama(path, SPEC, seed=2, arch="qwen2")
    return path, _hf_logits(path)


@pytest.fixture(scope="module")
def qwen2_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2q8") / "tiny-qwen2-q8_0.gguf"
    write_tiny_llama(path, SPEC, seed=2, arch="qwen2", quantized="Q8_0")
    return path, _hf_logits(path)


def test_qwen2_on_the_torch_backend(qwen2):
    path, want = qwen2
    config, dense, _ = load_gguf(path)
    assert not config.rotary_pairs_interleaved
    got = _forward(LlamaModel(config, dense, max_positions=64), config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    del dense["blk.0.attn_q.bias"], dense["blk.0.attn_k.bias"], dense["blk.0.attn_v.bias"]
    unbiased = _forward(LlamaModel(config, dense, max_positions=64), config)
    assert (unbiased - want).abs().max() > 0.1  # the biases matter to this model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
    write_tiny_llama(path, QWEN3_SPEC, seed=3, arch="qwen3")
    return path, _hf_logits(path, "Qwen3")


@pytest.fixture(scope="module")
def qwen3_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3q8") / "tiny-qwen3-q8_0.gguf"
    write_tiny_llama(path, QWEN3_SPEC, seed=3, arch="qwen3", quantized="Q8_0")
    return path, _hf_logits(path, "Qwen3")


def test_qwen3_on_the_torch_backend(qwen3):
    path, want = qwen3
    config, dense, _ = load_gguf(path)
    assert (config.head_dim, config.qk_norm, config.rotary_pairs_interleaved) == (128, True,
                                                                                  False)
    got = _forward(LlamaModel(config, dense, max_positions=64), config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    for i in range(config.num_layers):
        dense[f"blk.{i}.attn_q_norm.weight"] = torch.ones(128)
    unnormed = _forward(LlamaModel(config, dense, max_positions=64), config)
    assert (unnormed - want).abs().max() > 0.1  # the norms' weights matter to this model


def test_qwen3_without_its_norms_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "broken-qwen3.gguf"
    weights = write_tiny_llama(tmp_path / "whole.gguf", QWEN3_SPEC, seed=3, arch="qwen3")
    reader = gguf.GGUFReader(str(tmp_path / "whole.gguf"))
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                                 else None)
    for name, array in weights.items():
        if name != "blk.1.attn_k_norm.weight":
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="blk.1.attn_k_norm.weight"):
        load_gguf(path)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("path_name", ["graphs", "int_step"])
def test_every_cpu_backend(request, family, path_name):
    path, want = request.getfixturevalue(f"{family}_q8")
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    exact = path_name == "graphs"
    if not exact and load_library() is None:
        pytest.skip("no C++ compiler: the integer kernel was not built")
    model = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2, exact=exact,
                          integer_kernel=not exact)
    got = _forward(model, config, torch.float32 if exact else torch.float16)
    if exact:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # int8 activations, float16 KV: as close as that rounding allows
        assert_within_rounding_noise(got, want, _dithered(path, graphs=False))


def _dithered(path, graphs: bool) -> torch.Tensor:
    """Draws of the fast mode's rounding on this file (rounding_noise.py)."""
    model, noise = fast_mode_model(path, graphs=graphs, max_positions=64)
    return draws(model, lambda m: _forward(m, model.config), noise)


# Gemma 3 at its real head size (256, what transformers scales attention by): six layers, so
# five slide and the sixth attends globally; a window of 8 keys, well short of the 40 tokens.
GEMMA3_SPEC = TinySpec(num_layers=6, num_heads=2, num_kv_heads=1, head_size=256,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tied=True, sliding_window=8)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    write_tiny_llama(path, GEMMA3_SPEC, seed=5, arch="gemma3")
    return path, _hf_logits(path, "Gemma3")


def test_gemma3_on_the_torch_backend(gemma3):
    path, want = gemma3
    config, dense, _ = load_gguf(path)
    assert [config.window(i) for i in range(6)] == [8, 8, 8, 8, 8, 0]
    assert (config.embedding_scale, config.scale) == (8.0, 1 / 16)
    got = _forward(LlamaModel(config, dense, max_positions=64), config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # The window matters: a window wider than the context is another model past 8 tokens.
    unwindowed = _forward(LlamaModel(replace(config, sliding_window=1000), dense,
                                     max_positions=64), config)
    assert (unwindowed - want)[8:].abs().max() > 1e-2
    torch.testing.assert_close(unwindowed[:8], want[:8], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gemma3_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3q8") / "tiny-gemma3-q8_0.gguf"
    write_tiny_llama(path, GEMMA3_SPEC, seed=5, arch="gemma3", quantized="Q8_0")
    return path, _hf_logits(path, "Gemma3")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_gemma3_on_the_cpu_backend(gemma3_q8, exact):
    """ONNX Runtime's graphs (the integer kernel does not take Gemma's layers), the window in
    the torch attention; exact: equal to transformers; fast (int8 activations, float16 KV):
    as close as that rounding allows (rounding_noise.py)."""
    path, want = gemma3_q8
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False,
                                      exact=exact)
    model = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2, exact=exact)
    assert model.int_step is None
    got = _forward(model, config, torch.float32 if exact else torch.float16)
    if exact:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert_within_rounding_noise(got, want, _dithered(path, graphs=True))


# Qwen3-MoE: eight experts, two per token. Experts of 768 (transformers reads no expert width
# from a GGUF: its default, 768, is the file's here).
MOE_SPEC = TinySpec(head_size=128, num_experts=8, num_experts_used=2, expert_size=768)


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3moe.gguf"
    write_tiny_llama(path, MOE_SPEC, seed=9, arch="qwen3moe", quantized="Q8_0")
    return path, _hf_logits(path, "Qwen3Moe")


def test_qwen3moe_on_the_torch_backend(qwen3moe, monkeypatch):
    """Equal to transformers, with the tokens of one batch routed to different experts (the
    router's choices are recorded as the model makes them)."""
    from llmbus.services.executor.backends import moe

    path, want = qwen3moe
    config, dense, _ = load_gguf(path)
    assert (config.num_experts, config.num_experts_used, config.expert_intermediate_size) == (
        8, 2, 768)
    chosen = []

    def recorded_route(x, router, top_k):
        weights, experts = route(x, router, top_k)
        chosen.append(experts)
        return weights, experts

    route = moe.route
    monkeypatch.setattr(moe, "route", recorded_route)
    got = _forward(LlamaModel(config, dense, max_positions=64), config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert len(chosen) == config.num_layers
    for experts in chosen:  # [T, 2] per layer: every expert used, tokens choosing apart
        assert set(experts.flatten().tolist()) == set(range(8))
        assert len({tuple(sorted(pair)) for pair in experts.tolist()}) >= 8


def test_qwen3moe_in_the_integer_kernel(qwen3moe, monkeypatch):
    """The fast mode: every expert tiled for the kernel (none dense), as close to transformers
    as its rounding allows, and a step runs each expert its tokens chose once, on all of them
    together."""
    from llmbus.services.executor.backends import moe
    from llmbus.services.executor.weights.quant_parts import QuantPart, tile_as_loaded

    if load_library() is None:
        pytest.skip("no C++ compiler: the integer kernel was not built")
    path, want = qwen3moe
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False,
                                      transform=tile_as_loaded)
    experts = [n for n in native if "_exps." in n]
    assert len(experts) == 3 * 8 * config.num_layers
    assert all(isinstance(native[n], QuantPart) for n in experts)
    assert not [n for n in dense if "_exps" in n]  # no dense copy of any expert
    model = CpuLlamaModel(config, dense, native, max_positions=64, num_threads=2,
                          integer_kernel=True, release_native=True)
    calls = []
    mlp = moe.moe_mlp

    def counted(x, router, expert_mlp, top_k):
        def expert(e, rows):
            calls.append((e, rows.shape[0]))
            return expert_mlp(e, rows)
        return mlp(x, router, expert, top_k)

    monkeypatch.setattr("llmbus.services.executor.backends.int_moe.moe_mlp", counted)
    got = _forward(model, config, torch.float16)
    assert_within_rounding_noise(got, want, _dithered(path, graphs=False))
    per_layer = [calls[i:i + 8] for i in range(0, len(calls), 8)]
    assert len(calls) == 8 * config.num_layers  # every expert once a layer, 40 tokens x 2
    for layer in per_layer:
        assert sorted(e for e, _ in layer) == list(range(8))
        assert sum(n for _, n in layer) == len(TOKENS) * 2


def test_gemma3_without_its_window_is_refused_by_name(tmp_path):
    """Without its window a Gemma 3 would load as another model: refused, naming the key."""
    path = tmp_path / "no-window.gguf"
    write_tiny_llama(path, replace(GEMMA3_SPEC, sliding_window=0), arch="gemma3")
    with pytest.raises(UnsupportedModelError, match="'gemma3.attention.sliding_window'"):
        load_gguf(path)

"""Matmuls over the GGUF's own quantized blocks (linear.py): torch's CPU int4 kernel for
bfloat16/float16, and llmbus's exact float32 Q4_1/Q8_0 kernel (cpu_kernels/quant_matmul.py/.cpp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbus.services.executor.cpu_kernels.library import build, load_library, quant_matmul_runs
from llmbus.services.executor.cpu_kernels.quant_matmul import (
    KERNEL_MAX_ROWS,
    Q4_1Float32Linear,
    Q8_0Float32Linear,
    pack_codes,
)
from llmbus.services.executor.gguf_loader import load_gguf
from llmbus.services.executor.gguf_quants import Q4_1Weight, Q8_0Weight
from llmbus.services.executor.linear import INT4_MAX_ROWS, DenseLinear, Int4Linear, make_linear
from llmbus.services.executor.runner import ModelRunner
from tests.gguf_fixtures import TinySpec, generate, write_tiny_llama

SPEC = TinySpec()
BLOCK_SIZE = 4
KERNEL_RUNS = quant_matmul_runs(load_library())
needs_kernel = pytest.mark.skipif(not KERNEL_RUNS, reason="the float32 kernel needs AVX-512 "
                                  "and a C++ compiler (see cpu_kernels/library.py)")


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized") / "tiny-q4_1.gguf"
    return path, write_tiny_llama(path, SPEC, quantized="Q4_1")


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    write_tiny_llama(path, SPEC)
    return path


def random_q4_1(out: int, inp: int, seed: int = 0) -> Q4_1Weight:
    g = torch.Generator().manual_seed(seed)
    groups = inp // 32
    scales = (torch.rand(out, groups, generator=g) * 0.02).half().float()
    minimums = (-8 * scales + torch.randn(out, groups, generator=g) * 0.01).half().float()
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    return Q4_1Weight(codes, scales, minimums)


def random_q8_0(out: int, inp: int, seed: int = 0) -> Q8_0Weight:
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(out, inp // 32, generator=g) * 0.002).half().float()
    codes = torch.randint(-127, 128, (out, inp), generator=g, dtype=torch.int8)
    return Q8_0Weight(codes, scales)


@pytest.mark.parametrize("layer_format", ["Q4_1", "Q4_0", "Q8_0"])
def test_native_weights_dequantize_exactly_to_gguf_values(layer_format, tmp_path):
    """Q4_0 arrives in Q4_1 form (minimum -8 d); every format dequantizes to gguf-py's bits."""
    path = tmp_path / f"tiny-{layer_format}.gguf"
    written = write_tiny_llama(path, SPEC, quantized=layer_format)
    _, dense, native = load_gguf(path, keep_native=True)
    matrices = {n for n, w in written.items() if w.ndim == 2}
    assert set(native) == matrices  # norms stay F32
    for name in matrices:
        q = native[name]
        kind = (Q8_0Weight if layer_format == "Q8_0" or not name.startswith("blk.")
                else Q4_1Weight)
        assert isinstance(q, kind), name
        # Q and K rows went through the rotary un-permute: codes, scales and minimums alike
        assert torch.equal(q.dequantize(), dense[name]), name
        assert np.array_equal(dense[name].numpy(), written[name]), name
    assert load_gguf(path)[2] == {}  # only on request


def test_packed_codes_are_the_gguf_bytes(tiny_quantized):
    """pack_codes restores Q4_1's own nibble order: the packed bytes of a tensor without the
    rotary permutation equal the code bytes stored in the file."""
    import gguf

    path, _ = tiny_quantized
    _, _, native = load_gguf(path, keep_native=True)
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors
                  if t.name == "blk.0.ffn_down.weight")
    raw = np.asarray(tensor.data).reshape(SPEC.hidden_size, -1, 20)[..., 4:]  # codes of blocks
    packed = pack_codes(native["blk.0.ffn_down.weight"].codes).numpy()
    assert np.array_equal(packed.reshape(raw.shape), raw)


@pytest.mark.parametrize("rows", [1, 3, 16, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_linear_matches_the_dequantized_matmul(rows, dtype):
    q = random_q4_1(96, 128)
    exact = q.dequantize()  # float32, the GGUF's weight values
    linear = Int4Linear(q, exact.to(dtype))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = linear(x).float()
    want = x.float() @ exact.T
    if rows > INT4_MAX_ROWS:  # big steps take the dense GEMM
        assert torch.equal(got, F.linear(x, exact.to(dtype)).float())
    # scales and zeros are rounded to the compute dtype, like the dense weights are
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 5])
@pytest.mark.parametrize("out_in", [(96, 128), (7, 64), (10, 96)])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_float32_kernel_matches_the_dequantized_matmul(rows, out_in, kind):
    """Every tile shape: row counts around the 4-row tile, output counts around the 4-column
    tile, two and three groups of 32 inputs; above KERNEL_MAX_ROWS, the dense GEMM. Errors at
    float32 level (summation order only)."""
    out, inp = out_in
    q = (random_q4_1 if kind == "q4_1" else random_q8_0)(out, inp, seed=out + inp)
    layer = (Q4_1Float32Linear if kind == "q4_1" else Q8_0Float32Linear)
    linear = layer(q, load_library(), q.dequantize())
    assert torch.equal(linear.dequantize(), q.dequantize())  # the weights, bit for bit
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    want = x.double() @ q.dequantize().double().T
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    if rows <= KERNEL_MAX_ROWS:  # the one-row path and the tile path sum in the same order
        assert torch.equal(linear(x[:1]), got[:1])
    with pytest.raises(ValueError, match="expected a CPU input"):
        linear(torch.randn(rows, inp + 32))  # would read past the end of each weight row


def test_make_linear_picks_the_kernel_by_dtype_and_format():
    parts = [random_q4_1(32, 64, seed=1), random_q4_1(64, 64, seed=2)]
    exact = torch.cat([p.dequantize() for p in parts])
    linear = make_linear(exact.bfloat16(), parts)
    assert isinstance(linear, Int4Linear)
    x = torch.randn(2, 64).bfloat16()
    torch.testing.assert_close(linear(x).float(), x.float() @ exact.T, atol=0.05, rtol=0.02)
    assert isinstance(make_linear(exact, None), DenseLinear)
    with pytest.raises(ValueError, match="int4 kernel"):
        Int4Linear(parts[0], parts[0].dequantize())  # float32: torch's slow path
    head = random_q8_0(40, 64)
    mixed = [parts[0], head]
    assert isinstance(make_linear(torch.cat([p.dequantize() for p in mixed]), mixed),
                      DenseLinear)
    # Q8_0 returns float32: a bfloat16 model takes it for the vocab head only
    assert isinstance(make_linear(head.dequantize().bfloat16(), [head]), DenseLinear)
    if KERNEL_RUNS:
        assert isinstance(make_linear(exact, parts), Q4_1Float32Linear)
        assert isinstance(make_linear(head.dequantize().bfloat16(), [head], head=True),
                          Q8_0Float32Linear)


def test_bfloat16_native_runner_generates_like_the_dense_runner(tiny_quantized):
    """The int4 decode steps (and the float32 Q8_0 head) follow the dense bfloat16 path."""
    path, _ = tiny_quantized
    runners = {w: ModelRunner(path, model_name="t", dtype=torch.bfloat16, block_size=BLOCK_SIZE,
                              num_blocks=128, weights=w) for w in ("native", "dense")}
    assert runners["native"].weight_format == "native"
    assert runners["dense"].weight_format == "dense"
    assert isinstance(runners["native"].model.layers[0].qkv, Int4Linear)
    prompts = [[5, 9, 13, 200, 31], [7, 7, 100], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    outputs = {w: generate(r, prompts, max_tokens=12) for w, r in runners.items()}
    assert outputs["native"] == outputs["dense"]


@needs_kernel
@pytest.mark.parametrize("layer_format", ["Q4_1", "Q4_0", "Q8_0"])
def test_float32_native_runner_is_the_exact_path(layer_format, tmp_path):
    """Same weights as dense float32, bit for bit: the same greedy tokens, whatever the file's
    layer format."""
    path = tmp_path / f"tiny-{layer_format}.gguf"
    write_tiny_llama(path, SPEC, quantized=layer_format)
    runners = {w: ModelRunner(path, model_name="t", block_size=BLOCK_SIZE, num_blocks=128,
                              weights=w) for w in ("native", "dense")}
    model = runners["native"].model
    layer_kind = Q8_0Float32Linear if layer_format == "Q8_0" else Q4_1Float32Linear
    assert isinstance(model.layers[1].gate_up, layer_kind)
    assert isinstance(model.lm_head, Q8_0Float32Linear)
    prompts = [[5, 9, 13, 200, 31], [7, 7, 100], list(range(3, 40))]
    outputs = {w: generate(r, prompts, max_tokens=12, chunk_size=8) for w, r in runners.items()}
    assert outputs["native"] == outputs["dense"]


def test_kernel_build_is_cached_and_reports_compiler_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMBUS_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        build(compiler="false")  # a "compiler" that always fails
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind
    if load_library() is None:
        return
    first = build()
    stamp = first.stat().st_mtime_ns
    assert build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt


def test_weights_option_is_checked(tiny_quantized, tiny_f32, tmp_path):
    path, _ = tiny_quantized
    with pytest.raises(ValueError, match="no Q4_0, Q4_1 or Q8_0"):
        ModelRunner(tiny_f32, model_name="t", dtype=torch.bfloat16, num_blocks=16,
                    weights="native")
    q8_layers = tmp_path / "tiny-q8_0.gguf"
    write_tiny_llama(q8_layers, SPEC, quantized="Q8_0")
    with pytest.raises(ValueError, match="no kernel here reads"):  # Q8_0 layers: float32 only
        ModelRunner(q8_layers, model_name="t", dtype=torch.bfloat16, num_blocks=16,
                    weights="native")
    with pytest.raises(ValueError, match="unknown weights"):
        ModelRunner(path, model_name="t", num_blocks=16, weights="int3")
    assert ModelRunner(tiny_f32, model_name="t", dtype=torch.bfloat16,
                       num_blocks=16).weight_format == "dense"  # nothing quantized in the file
    assert ModelRunner(path, model_name="t", dtype=torch.bfloat16,
                       num_blocks=16).weight_format == "native"
    assert ModelRunner(path, model_name="t", num_blocks=16).weight_format == (
        "native" if KERNEL_RUNS else "dense")  # float32: only with the kernel

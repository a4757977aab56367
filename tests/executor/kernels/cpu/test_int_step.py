"""llmbus's integer kernel (kernels/cpu/int_step.cpp, backends/int_step.py): each matmul kind
against a torch reference of the same arithmetic, for every ISA build this CPU can run; the
whole forward against the exact one on the default model, and across builds."""

from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

from llmbus.services.cpu_features import cpu_flags
from llmbus.services.executor.backends.cpu_llama import CpuLlamaModel
from llmbus.services.executor.backends.int_step import int_linear
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kernels.cpu.library import load_library
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.gguf_quants import Q4_1Weight, Q8_0Weight, parse_q4_k
from llmbus.services.executor.weights.k_quants import FORMATS, KQuantWeight
from llmbus.services.executor.weights.k_quants import parse as parse_k_quant
from llmbus.services.executor.weights.quant_parts import QuantPart
from llmbus.services.model_files import default_model_path
from tests.cpu_isas import ISAS
from tests.gguf_fixtures import random_k_quant
from tests.int_kernel_emulation import decode_logits, emulated_linear

needs_compiler = pytest.mark.skipif(load_library() is None, reason="no C++ compiler here")
GROUP = 32
BATCH = 12  # decodes of a step: above the small steps' int16 down projections


def _weight(kind: str, n: int, k: int, gen: torch.Generator) -> Q4_1Weight | Q8_0Weight:
    scales = torch.rand(n, k // GROUP, generator=gen).half().float() * 0.02
    if kind == "q8_0":
        return Q8_0Weight(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8),
                          scales)
    mins = (-8 * scales if kind == "q4_0"
            else (torch.randn(n, k // GROUP, generator=gen) * 0.05).half().float())
    return Q4_1Weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), scales,
                      mins)


def _reference(weight: Q4_1Weight | Q8_0Weight | KQuantWeight, x: torch.Tensor,
               wide: bool) -> torch.Tensor:
    """The kernel's arithmetic in float64: x quantized per block of 32 (d = max|x| / 127 for
    int8, / 32767 for the int16 of `wide` Q4 inputs; round half to even); Q4's minimums times
    the block's sum of quantized x, d * sum(q); a K-quant's weights as dequantized (their
    scales the same float32 products as the kernel's)."""
    t, k = x.shape
    blocks = x.double().view(t, k // GROUP, GROUP)
    top = 32767 if wide and isinstance(weight, Q4_1Weight) else 127
    d = blocks.abs().amax(-1, keepdim=True) / top
    xq = torch.where(d > 0, torch.round(blocks / d), 0) * d
    if isinstance(weight, KQuantWeight):
        return (xq.view(t, k) @ weight.dequantize().double().T).float()
    codes = weight.codes.double().view(-1, k // GROUP, GROUP)  # [N, G, 32]
    y = torch.einsum("tgi,ngi,ng->tn", xq, codes, weight.scales.double())
    if isinstance(weight, Q4_1Weight):
        y += torch.einsum("tg,ng->tn", xq.sum(-1), weight.minimums.double())
    return y.float()


@needs_compiler
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,wide", [("q4_1", False), ("q4_1", True), ("q4_0", False),
                                       ("q4_0", True), ("q8_0", False), ("q8_0", True)])
@pytest.mark.parametrize("tokens,k", [(1, 256), (3, 96), (4, 256), (7, 256), (9, 96),
                                      (16, 256), (19, 256), (300, 64)])
def test_matmul_matches_reference(isa, kind, wide, tokens, k):
    """Row counts around the kernels' register tiles (8 rows with AVX-512, else 4; then 2 and
    1), an odd number of blocks (k = 96), int8 and int16 (`wide`) activations."""
    lib = load_library(isa)
    gen = torch.Generator().manual_seed(tokens)
    weights = [_weight(kind, n, k, gen) for n in (40, 24)]  # a row-stack of two, like gate+up
    x = torch.randn(tokens, k, generator=gen)
    x[:, 5] *= 30  # an outlier channel, as hidden states have
    x[0, :GROUP] = 0  # an all-zero block quantizes to zeros, not NaN
    expected = torch.cat([_reference(w, x, wide) for w in weights], dim=1)
    for threads in (1, 2):
        got = int_linear(lib, [QuantPart.of(w) for w in weights], x, tokens if wide else 0,
                           threads)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@needs_compiler
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("tokens", [1, 19])
def test_k_quants_at_their_bits_match_their_reference(isa, kind, tokens):
    """Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS at the file's bits (bit planes, integer
    sub-scales, minimums or a codebook): the values are gguf-py's exactly, and the matmul is
    the int8 arithmetic's, for every row tile (19 rows: 8 + 8 + 2 + 1 with AVX-512, 4 x 4 +
    2 + 1 with AVX2)."""
    lib = load_library(isa)
    k = 512
    qtype = gguf.GGMLQuantizationType[kind]
    weights = []
    for seed, n in enumerate((40, 24)):
        raw = random_k_quant(qtype, n, k, seed=seed + tokens, scale=0.05)
        weight = parse_k_quant(kind, raw, (n, k))
        expected = gguf.quants.dequantize(raw, qtype).reshape(n, k)
        assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
        weights.append(weight)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=gen)
    x[:, 5] *= 30
    x[0, :GROUP] = 0
    expected = torch.cat([_reference(w, x, False) for w in weights], dim=1)
    for threads in (1, 2):
        got = int_linear(lib, [QuantPart.of(w) for w in weights], x, 0, threads)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@needs_compiler
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wide", [False, True])
def test_q4_k_kept_factored_gives_the_same_bits_as_in_q4_1_form(isa, wide):
    """A Q4_K matrix whose scales stay factored (super-block float x 6-bit sub-scale, 0.59
    bytes a weight) multiplies bit for bit like its Q4_1 form (0.75 bytes a weight): the
    kernel forms the same float32 products that loading it in Q4_1 form does."""
    lib = load_library(isa)
    q4_k = [parse_q4_k(random_k_quant(gguf.GGMLQuantizationType.Q4_K, n, 512, seed=n),
                       (n, 512)) for n in (16, 8)]
    factored = [QuantPart.of(w) for w in q4_k]
    plain = [QuantPart.of(replace(w, k_factors=None)) for w in q4_k]
    assert factored[0].sub_scales is not None and plain[0].sub_scales is None
    assert factored[0].scales.numel() * 8 == plain[0].scales.numel()
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    for threads in (1, 2):
        assert torch.equal(int_linear(lib, factored, x, 5 if wide else 0, threads),
                           int_linear(lib, plain, x, 5 if wide else 0, threads))
    torch.testing.assert_close(  # and it is the matmul of the dequantized weights
        int_linear(lib, factored, x, 5 if wide else 0),
        torch.cat([_reference(w, x, wide) for w in q4_k], dim=1), atol=1e-4, rtol=1e-4)


def test_tiling_8_bit_codes_in_their_own_memory_gives_the_same_tiles():
    gen = torch.Generator().manual_seed(5)
    weight = _weight("q8_0", 8 * 300, 96, gen)  # more column groups than one chunk of them
    expected = QuantPart.of(weight)
    before = weight.codes.data_ptr()
    consumed = QuantPart.of(weight, consume=True)
    assert consumed.codes.data_ptr() == before  # no second copy of the codes
    assert torch.equal(consumed.codes, expected.codes)
    assert torch.equal(consumed.scales, expected.scales)


@needs_compiler
def test_refuses_what_it_cannot_multiply():
    lib = load_library()
    gen = torch.Generator().manual_seed(0)
    part = QuantPart.of(_weight("q4_1", 8, 64, gen))
    with pytest.raises(RuntimeError, match="refused"):  # parts of different widths
        int_linear(lib, [part, QuantPart.of(_weight("q8_0", 8, 32, gen))], torch.ones(1, 64))
    with pytest.raises(ValueError, match="N % 8"):  # no whole column groups to tile
        QuantPart.of(_weight("q4_1", 12, 64, gen))
    with pytest.raises(ValueError, match="1 to 3"):
        int_linear(lib, [part] * 4, torch.ones(1, 64))


@needs_compiler
@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags(),
                    reason="no AVX-512 build to compare with")
@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("tokens", [16, 37, 300])
def test_the_native_build_gives_the_avx512_builds_bits(tokens, factored):
    """Where the CPU has AMX, the native build takes steps of 16 tokens or more through its
    tiles (amx_tiles.h); the AVX-512 build never does. Same integer sums, same float
    arithmetic after them: the same bits, row tiles of 16 and the rows left over alike."""
    native, avx512 = load_library("native"), load_library("avx512")
    gen = torch.Generator().manual_seed(tokens)
    if factored:  # Q4_K, its scales kept factored (super-block float x sub-scale)
        weights = [parse_q4_k(random_k_quant(gguf.GGMLQuantizationType.Q4_K, n, 512, seed=n),
                              (n, 512)) for n in (40, 24)]
    else:
        weights = [_weight("q4_1", n, 256, gen) for n in (40, 24)]
    parts = [QuantPart.of(w) for w in weights]
    x = torch.randn(tokens, parts[0].k, generator=gen)
    x[:, 5] *= 30
    for threads in (1, 2):
        assert torch.equal(int_linear(native, parts, x, 0, threads),
                           int_linear(avx512, parts, x, 0, threads))


@needs_compiler
@pytest.mark.parametrize("isa", ISAS)
def test_a_kernel_call_leaves_the_callers_denormals_as_it_found_them(isa):
    """The kernels treat denormals as zero while they run (flush_denormals.h), and only then:
    the calling thread's torch arithmetic still keeps 2^-140 afterwards."""
    lib = load_library(isa)
    smallest = torch.tensor([2.0 ** -140])  # a denormal float32
    assert (smallest * 1.0).item() > 0  # this thread keeps denormals before the call
    part = QuantPart.of(_weight("q4_1", 8, 64, torch.Generator().manual_seed(0)))
    int_linear(lib, [part], torch.randn(3, 64), 0, 2)
    assert (smallest * 1.0).item() == 2.0 ** -140


@pytest.mark.model
@needs_compiler
@pytest.mark.skipif(not default_model_path().is_file(), reason="default model not pulled")
def test_steps_follow_the_exact_forward_as_closely_as_their_arithmetic_allows():
    """The kernel's decode logits against the exact graphs', measured against the same
    arithmetic done in torch (int8/int16 activations per block, a float16 KV cache).

    Quantization makes the forward discontinuous: a last-bit change flips roundings, which the
    later layers carry on (two kernel builds that differed only in a block sum's summation
    order gave logits up to 2.9 apart). So no bound read off one machine's run holds; what
    does is that the kernel is no further from exact than its own arithmetic, computed
    independently: both are draws of the same rounding noise. The statistic is the median
    over the 52 rows of 1 - cos (the mean is ruled by the odd flat-prediction row and moved 7x
    between draws); drawn six times (inputs scaled by 1 + k 2^-20) it moved within +-8%, so a
    factor 1.5 is room for the draw. By this measure the kernel that took Q4's minimums times
    x's float block sums was 3.3x its arithmetic's noise (3.6e-5 against 1.1e-5)."""
    config, dense, native = load_gguf(default_model_path(), keep_native=True,
                                      dense_for_native=False)
    exact_model = CpuLlamaModel(config, dense, native, max_positions=64, exact=True,
                                num_threads=2)
    kernel_model = CpuLlamaModel(config, dense, native, max_positions=64, integer_kernel=True,
                                 num_threads=2)
    assert exact_model.int_step is None and exact_model.graphs
    assert kernel_model.graphs == []  # the kernel replaces every ONNX Runtime session
    exact = decode_logits(exact_model, config, torch.float32)
    kernel = decode_logits(kernel_model, config, torch.float16)
    _, dense_weights, _ = load_gguf(default_model_path())
    torch_model = LlamaModel(config, dense_weights, max_positions=64)
    torch_model.linear = emulated_linear(torch_model)
    emulated = decode_logits(torch_model, config, torch.float16)

    def distance(logits: torch.Tensor) -> torch.Tensor:  # [rows]
        return 1 - torch.nn.functional.cosine_similarity(exact, logits, dim=-1)

    noise = distance(emulated).median()
    assert noise > 0  # the emulation did quantize
    assert distance(kernel).median() <= 1.5 * noise, (distance(kernel), noise)


@pytest.fixture(scope="module")
def default_model():
    if not default_model_path().is_file():
        pytest.skip("default model not pulled")
    return load_gguf(default_model_path(), keep_native=True, dense_for_native=False)


def _kernel_steps(default_model, isa: str) -> torch.Tensor:
    config, dense, native = default_model
    model = CpuLlamaModel(config, dense, native, max_positions=64, integer_kernel=True,
                          isa=isa, num_threads=2)
    return decode_logits(model, config, torch.float16)


@needs_compiler
@pytest.mark.model
@pytest.mark.parametrize("isa", [p for p in ISAS if p.values[0] in ("avx2", "avx512")])
def test_every_vector_build_computes_the_same_bits(default_model, isa):
    """The whole fast forward built for AVX2 or AVX-512 equals this CPU's native build's, bit
    for bit: integer dot products are exact, and every float sum has one fixed order. (The
    plain-loop build has no FMA, so it rounds differently; it is checked per matmul above.)"""
    assert torch.equal(_kernel_steps(default_model, isa), _kernel_steps(default_model, "native"))


@needs_compiler
@pytest.mark.model
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_the_layers_in_one_call_compute_the_bits_of_the_python_loop(default_model, kv_dtype):
    """step_layers.cpp makes the calls of IntStep.layers' Python loop in the same order, so
    prompt and decode steps give the same logits, bit for bit."""
    config, dense, native = default_model
    model = CpuLlamaModel(config, dense, native, max_positions=64, integer_kernel=True,
                          num_threads=2)
    assert model.fused_layers
    fused = decode_logits(model, config, kv_dtype)
    model.fused_layers = False
    assert torch.equal(fused, decode_logits(model, config, kv_dtype))

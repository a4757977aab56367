"""Q4_1 weights read natively and multiplied by torch's CPU int4 kernel (linear.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from services.executor.gguf_loader import Q4_1Weight, load_gguf
from services.executor.linear import INT4_MAX_ROWS, DenseLinear, Int4Linear, make_linear
from services.executor.runner import ModelRunner
from tests.gguf_fixtures import TinySpec, generate, write_tiny_llama

SPEC = TinySpec()
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4_1") / "tiny-q4_1.gguf"
    return path, write_tiny_llama(path, SPEC, q4_1=True)


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    write_tiny_llama(path, SPEC)
    return path


def test_native_q4_1_dequantizes_exactly_to_gguf_values(tiny_q4_1):
    path, written = tiny_q4_1
    _, dense, native = load_gguf(path, keep_q4_1=True)
    matmul_names = {n for n, w in written.items() if n.startswith("blk.") and w.ndim == 2}
    assert set(native) == matmul_names  # norms and embeddings stay F32
    for name in matmul_names:
        q = native[name]
        assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
        # Q and K rows went through the rotary un-permute: codes, scales and minimums alike
        assert torch.equal(q.dequantize(), dense[name]), name
        assert np.array_equal(dense[name].numpy(), written[name]), name
    assert load_gguf(path)[2] == {}  # only on request


def random_q4_1(out: int, inp: int, seed: int = 0) -> Q4_1Weight:
    g = torch.Generator().manual_seed(seed)
    groups = inp // 32
    scales = (torch.rand(out, groups, generator=g) * 0.02).half().float()
    minimums = (-8 * scales + torch.randn(out, groups, generator=g) * 0.01).half().float()
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    return Q4_1Weight(codes, scales, minimums)


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


def test_make_linear_stacks_parts_and_refuses_bad_dtypes():
    parts = [random_q4_1(32, 64, seed=1), random_q4_1(64, 64, seed=2)]
    exact = torch.cat([p.dequantize() for p in parts])
    linear = make_linear(exact.bfloat16(), parts)
    assert isinstance(linear, Int4Linear)
    x = torch.randn(2, 64).bfloat16()
    torch.testing.assert_close(linear(x).float(), x.float() @ exact.T, atol=0.05, rtol=0.02)
    assert isinstance(make_linear(exact, None), DenseLinear)
    with pytest.raises(ValueError, match="int4 kernel"):
        Int4Linear(parts[0], parts[0].dequantize())  # float32: the kernel's slow path


def test_q4_1_runner_generates_like_the_dense_runner(tiny_q4_1):
    """bfloat16 both: the int4 decode steps follow the dense bfloat16 path token for token."""
    path, _ = tiny_q4_1
    runners = {w: ModelRunner(path, model_name="t", dtype=torch.bfloat16, block_size=BLOCK_SIZE,
                              num_blocks=128, weights=w) for w in ("q4_1", "dense")}
    assert runners["q4_1"].weight_format == "q4_1"
    assert runners["dense"].weight_format == "dense"
    assert isinstance(runners["q4_1"].model.layers[0].qkv, Int4Linear)
    prompts = [[5, 9, 13, 200, 31], [7, 7, 100], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    outputs = {w: generate(r, prompts, max_tokens=12) for w, r in runners.items()}
    assert outputs["q4_1"] == outputs["dense"]


def test_weights_option_is_checked(tiny_q4_1, tiny_f32):
    path, _ = tiny_q4_1
    with pytest.raises(ValueError, match="need the CPU and a dtype"):
        ModelRunner(path, model_name="t", num_blocks=16, weights="q4_1")  # float32
    with pytest.raises(ValueError, match="no Q4_1 tensors"):
        ModelRunner(tiny_f32, model_name="t", dtype=torch.bfloat16, num_blocks=16,
                    weights="q4_1")
    with pytest.raises(ValueError, match="unknown weights"):
        ModelRunner(path, model_name="t", num_blocks=16, weights="int3")
    auto = {ModelRunner(p, model_name="t", dtype=dtype, num_blocks=16).weight_format
            for p, dtype in ((path, torch.float32), (tiny_f32, torch.bfloat16))}
    assert auto == {"dense"}  # float32 compute, or no Q4_1 in the file
    assert ModelRunner(path, model_name="t", dtype=torch.bfloat16,
                       num_blocks=16).weight_format == "q4_1"

"""Residual add + RMSNorm kernel against its torch reference."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from llmbus.services.executor.kernels.triton.rmsnorm import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from tests.executor.kernels.triton.helpers import DEVICE, DTYPES, assert_close, gpu, requires_cuda  # noqa: E402

EPS = 1e-5


def _inputs(num_rows: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=g).to(dtype).to(DEVICE)
    residual = (4 * torch.randn(num_rows, hidden, generator=g)).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (65, 576), (3, 100)])
def test_rms_norm_matches_reference(dtype, shape):
    x, _, weight = _inputs(*shape, dtype)
    assert_close(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (9, 576), (3, 100)])
def test_add_rms_norm_matches_reference(dtype, shape):
    x, residual, weight = _inputs(*shape, dtype, seed=1)
    before = residual.clone()
    out, new_residual = add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_residual = add_rms_norm_reference(x, residual, weight, EPS)
    assert_close(out, expected_out)
    assert_close(new_residual, expected_residual)
    assert torch.equal(residual, before), "the input residual must not be modified"


def test_strided_rows_are_read_in_place():
    x, residual, weight = _inputs(5, 128, torch.float32)
    wide = torch.randn(5, 300, device=DEVICE)
    wide[:, 10:138] = x
    view = wide[:, 10:138]  # row stride 300
    assert_close(rms_norm(view, weight, EPS), rms_norm_reference(x, weight, EPS))


def test_launcher_rejects_bad_arguments():
    x, residual, weight = _inputs(4, 64, torch.float32)
    with pytest.raises(ValueError, match="weight: dtype"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="weight: axis 0"):
        rms_norm(x, weight[:32], EPS)
    with pytest.raises(ValueError, match="last axis must be contiguous"):
        rms_norm(x.t().contiguous().t(), weight[:4].contiguous(), EPS)
    with pytest.raises(ValueError, match="residual: axis 0"):
        add_rms_norm(x, residual[:2], weight, EPS)
    with pytest.raises(ValueError, match="expected 2 dims"):
        rms_norm(x[None], weight, EPS)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_rows_on_gpu(dtype):
    x, residual, weight = _inputs(4096, 4096, dtype)
    out, new_residual = add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_residual = add_rms_norm_reference(x, residual, weight, EPS)
    assert_close(out, expected_out)
    assert_close(new_residual, expected_residual)

"""SwiGLU over the fused gate/up projection against its torch reference."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from llmbus.services.executor.kernels.triton.swiglu import swiglu, swiglu_reference  # noqa: E402
from tests.executor.kernels.triton.helpers import DEVICE, DTYPES, assert_close, gpu, requires_cuda  # noqa: E402


def _gate_up(num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(num_rows * 1000 + width)
    return (3 * torch.randn(num_rows, 2 * width, generator=g)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 40), (37, 1536), (6, 123)])
def test_swiglu_matches_reference(dtype, shape):
    gate_up = _gate_up(*shape, dtype)
    assert_close(swiglu(gate_up), swiglu_reference(gate_up))


def test_reads_halves_of_a_strided_projection():
    gate_up = _gate_up(4, 48, torch.float32)
    wide = torch.zeros(4, 200, device=DEVICE)
    wide[:, :96] = gate_up
    assert_close(swiglu(wide[:, :96]), swiglu_reference(gate_up))


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="odd"):
        swiglu(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        swiglu(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="expected 2 dims"):
        swiglu(torch.zeros(8, device=DEVICE))


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_projection_on_gpu(dtype):
    gate_up = _gate_up(4096, 8192, dtype)
    assert_close(swiglu(gate_up), swiglu_reference(gate_up))

"""Residual add + RMSNorm in one pass, and plain RMSNorm.

For each row (D = hidden size, math in float32, rounding where eager torch rounds):

    h   = round(residual + x)                              # the updated residual
    out = round(weight * round(h / sqrt(mean(h ** 2) + eps)))

The variance is taken in float32 and the normalised row rounded to the input dtype before the
weight, as HF Llama does, so half-precision runs stay close to the float32 path. Fusing the
add saves one read and one write of the [T, D] activations per norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmbus.services.executor.kernels.triton._checks import (
    FLOAT_DTYPES,
    check_device,
    check_tensor,
    rows_per_program,
)
from llmbus.services.executor.kernels.triton._rounding import to_dtype


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, num_cols, stride_x, stride_residual, stride_out, stride_residual_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
    cols = tl.arange(0, BLOCK_COLS)  # [C]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < num_cols)  # [R, C]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + rows * stride_residual + cols[None, :], mask=mask,
                           other=0.0)
        x = to_dtype(x.to(tl.float32) + residual.to(tl.float32), dtype)
        tl.store(residual_out_ptr + rows * stride_residual_out + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / num_cols + eps)  # [R]
    normed = to_dtype(xf * rstd[:, None], dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols[None, :], to_dtype(weight[None, :] * normed, dtype),
             mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_device(x.device)
    check_tensor(x, "x", (None, None), FLOAT_DTYPES, x.device)
    num_rows, num_cols = x.shape
    check_tensor(weight, "weight", (num_cols,), (x.dtype,), x.device)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, D]
    residual_out = None
    if residual is not None:
        check_tensor(residual, "residual", (num_rows, num_cols), (x.dtype,), x.device)
        residual_out = torch.empty_like(out)  # [T, D]
    if num_rows == 0:
        return out, residual_out
    block_cols = triton.next_power_of_2(num_cols)
    # About 4096 elements per program on a GPU: 4 rows of the default model's 576, 1 of 4096.
    block_rows = rows_per_program(num_rows, on_gpu=max(1, 4096 // block_cols))
    num_warps = min(16, max(4, block_rows * block_cols // 512))
    grid = (triton.cdiv(num_rows, block_rows),)
    _rmsnorm_kernel[grid](
        x, residual if residual is not None else x, weight, out,
        residual_out if residual_out is not None else out,
        num_rows, num_cols, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=num_warps)
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D], weight [D] -> [T, D]. Grid: one program per BLOCK_ROWS rows."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, D] -> (rms_norm(residual + x) [T, D], residual + x [T, D])."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual

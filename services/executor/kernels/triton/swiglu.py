"""SwiGLU straight from the fused gate/up projection: out = silu(gate) * up.

The model's one matmul yields gate_up [T, 2F] with gate in columns [0, F) and up in [F, 2F)
(torch's `.chunk(2, -1)`); the kernel reads both halves in place, so no split copy exists:

    out[t, f] = round(round(g / (1 + exp(-g))) * up[t, f]),   g = gate_up[t, f]

silu is taken in float32 and rounded to the dtype before the product, as eager torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmbus.services.executor.kernels.triton._checks import (
    FLOAT_DTYPES,
    check,
    check_device,
    check_tensor,
    rows_per_program,
)
from llmbus.services.executor.kernels.triton._rounding import to_dtype


@triton.jit
def _swiglu_kernel(gate_up_ptr, out_ptr, num_rows, width, stride_in, stride_out,
                   BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [R]
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)  # [C]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < width)
    rows = rows.to(tl.int64)[:, None]
    gate = tl.load(gate_up_ptr + rows * stride_in + cols[None, :], mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + rows * stride_in + width + cols[None, :], mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = to_dtype(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols[None, :], to_dtype(silu * up.to(tl.float32), dtype),
             mask=mask)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] -> silu(gate) * up [T, F].

    Grid: (cdiv(T, BLOCK_ROWS), cdiv(F, BLOCK_COLS)).
    """
    check_device(gate_up.device)
    check_tensor(gate_up, "gate_up", (None, None), FLOAT_DTYPES, gate_up.device)
    num_rows, double_width = gate_up.shape
    check(double_width % 2 == 0, f"gate_up width {double_width} is odd")
    width = double_width // 2
    out = torch.empty(num_rows, width, dtype=gate_up.dtype, device=gate_up.device)  # [T, F]
    if num_rows == 0:
        return out
    block_rows = rows_per_program(num_rows, on_gpu=4)
    block_cols = min(1024, triton.next_power_of_2(width))
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(width, block_cols))
    _swiglu_kernel[grid](gate_up, out, num_rows, width, gate_up.stride(0), out.stride(0),
                         BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)
    return out


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

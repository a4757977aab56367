"""The model's matmuls: dense, or 4-bit weights read straight from the GGUF's Q4_1 blocks.

A decode step multiplies a few rows by every weight, so on the CPU it is bound by how many
weight bytes stream from memory: Q4_1 codes are an eighth of float32 and a quarter of bfloat16.
Larger steps (prefill chunks, big decode batches) are bound by arithmetic instead, where the
dense bfloat16 GEMM is faster than unpacking 4-bit codes, so `Int4Linear` keeps both and picks
by the number of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.executor.gguf_loader import Q4_1_GROUP, Q4_1Weight

# Rows at or below which the int4 kernel beats dense bfloat16 on the CPU (measured with
# bench/executor_throughput.py on 2 Zen 4 cores: int4 wins 2.2x at 1 row and 1.1x at 16,
# dense wins 1.3x at 64).
INT4_MAX_ROWS = 32
# Dtypes the CPU int4 kernel runs fast (its float32 path is a slow scalar loop).
INT4_DTYPES = (torch.bfloat16, torch.float16)


class DenseLinear:
    """y = x @ weight.T for weight [out, in]."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Int4Linear:
    """y = x @ weight.T with the weight kept as Q4_1 codes for steps of few rows.

    torch's CPU int4 kernel computes weight = (code - 8) * scale + zero per group; Q4_1 is
    weight = d * code + m, so scale = d and zero = m + 8 d (rounded to the compute dtype).
    """

    def __init__(self, q: Q4_1Weight, dense: torch.Tensor) -> None:
        if dense.dtype not in INT4_DTYPES or dense.device.type != "cpu":
            raise ValueError(f"the int4 kernel needs a CPU {INT4_DTYPES} weight, not "
                             f"{dense.device.type} {dense.dtype}")
        self.dense = dense  # [out, in]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.codes.to(torch.int32), 1)
        zeros = q.minimums + 8 * q.scales
        # [groups, out, 2] in the compute dtype, as the kernel expects
        self.scales_zeros = torch.stack([q.scales, zeros], dim=-1).transpose(0, 1) \
            .contiguous().to(dense.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT4_MAX_ROWS:
            return F.linear(x, self.dense)
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, Q4_1_GROUP,
                                                 self.scales_zeros)


def make_linear(dense: torch.Tensor, parts: list[Q4_1Weight] | None) -> DenseLinear | Int4Linear:
    """An `Int4Linear` over the row-stacked `parts` when given (they must stack to `dense`)."""
    if not parts:
        return DenseLinear(dense)
    q = Q4_1Weight(*(torch.cat([getattr(p, f) for p in parts])
                     for f in ("codes", "scales", "minimums")))
    return Int4Linear(q, dense)

"""The model's matmuls: dense, or weights read straight from the GGUF's quantized blocks.

A decode step multiplies a few rows by every weight, so on the CPU it is bound by how many
weight bytes stream from memory: Q4_1 codes are an eighth of float32 and a quarter of bfloat16.
Two Q4_1 paths, by compute dtype:

- float32: `Q4_1Float32Linear` (cpu_kernels/quant_matmul.py, Q4_0 too, in Q4_1 form), llmbus's
  own kernel; the weights are bit-identical to the dense float32 ones, so this is still the
  exact path. Q8_0 layers take `Q8_0Float32Linear`. The vocab head,
  usually Q8_0, takes the same kernel's Q8_0 form (`Q8_0Float32Linear`) in every dtype.
- bfloat16 / float16: `Int4Linear`, torch's CPU int4 kernel. Larger steps (prefill chunks, big
  decode batches) are bound by arithmetic instead, where the dense bfloat16 GEMM is faster than
  unpacking 4-bit codes, so it keeps both and picks by the number of rows.

Every quantized linear switches to its dense twin above a row count, and in bfloat16 the two
differ by rounding (the vocab head too: float32 Q8_0 weights below, bfloat16 above). So in
bfloat16 a sequence's logits depend slightly on how many tokens share its step; the float32
path has the same weights on both sides and differs only in summation order.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Protocol

import torch
import torch.nn.functional as F

from llmbus.services.executor.gguf_quants import Q4_1_GROUP, NativeWeight, Q4_1Weight, Q8_0Weight

# Rows at or below which the int4 kernel beats dense bfloat16 on the CPU (measured with
# bench/executor_throughput.py on 2 Zen 4 cores: int4 wins 2.2x at 1 row and 1.1x at 16,
# dense wins 1.3x at 64).
INT4_MAX_ROWS = 32
# Dtypes the CPU int4 kernel runs fast (its float32 path is a slow scalar loop).
INT4_DTYPES = (torch.bfloat16, torch.float16)


class Linear(Protocol):
    """y [rows, out] = x [rows, in] @ weight.T, whatever form the weight is kept in."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


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


def native_kernels_run(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a quantized kernel exists here for layer matmuls in this compute dtype."""
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        from llmbus.services.executor.cpu_kernels.library import load_library, quant_matmul_runs

        return quant_matmul_runs(load_library())
    return dtype in INT4_DTYPES


def make_linear(dense: torch.Tensor, parts: list[NativeWeight] | None, *,
                head: bool = False) -> Linear:
    """A quantized linear over the row-stacked `parts` (native forms of `dense`'s rows) when
    a kernel fits them, else a dense one; see the module doc for which kind.

    Q8_0 kernels return float32, so they serve float32 models, and the vocab `head` of any.
    """
    from llmbus.services.executor.cpu_kernels.library import load_library, quant_matmul_runs
    from llmbus.services.executor.cpu_kernels.quant_matmul import (
        Q4_1Float32Linear,
        Q8_0Float32Linear,
    )

    def stacked(kind):  # one weight of `kind` from the row-stacked parts (tensor fields)
        return kind(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(kind)
                      if f.default is MISSING))

    if not parts or dense.device.type != "cpu":
        return DenseLinear(dense)
    lib = load_library() if dense.dtype == torch.float32 or head else None
    lib = lib if quant_matmul_runs(lib) else None
    if all(isinstance(p, Q8_0Weight) for p in parts) and lib:
        return Q8_0Float32Linear(stacked(Q8_0Weight), lib, dense)
    if all(isinstance(p, Q4_1Weight) for p in parts):
        if dense.dtype in INT4_DTYPES:
            return Int4Linear(stacked(Q4_1Weight), dense)
        if lib:
            return Q4_1Float32Linear(stacked(Q4_1Weight), lib, dense)
    return DenseLinear(dense)

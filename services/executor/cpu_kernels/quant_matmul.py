"""Exact float32 matmuls over GGUF Q4_1 / Q8_0 blocks (quant_matmul.cpp).

torch has no fast float32 matmul over 4- or 8-bit weights (its int4 kernel's float32 path is a
scalar loop), so the executor carries its own; see quant_matmul.cpp for why the weights stay
bit-identical to the dequantized float32 ones.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from llmbus.services.executor.gguf_quants import QUANT_GROUP, Q4_1Weight, Q8_0Weight

# Rows at or below which the kernel beats the dense float32 GEMM (measured over SmolLM2's 120
# layer matmuls on 2 Zen 4 cores: 5.5x at 1 row, 1.7x at 16, 1.2x at 32, 0.85x at 48).
KERNEL_MAX_ROWS = 32


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> bytes [N, K / 2] in Q4_1's own order: within each group of 32,
    byte j holds input j in its low nibble and input j + 16 in its high nibble."""
    n, k = codes.shape
    halves = codes.view(n, k // QUANT_GROUP, 2, QUANT_GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class _QuantizedFloat32Linear:
    """y = x @ weight.T in float32 over a quantized weight, for steps of few rows.

    The weights are bit-identical to the dense float32 ones (see quant_matmul.cpp). Steps
    of up to KERNEL_MAX_ROWS rows run the kernel; bigger ones (prefill, big decode batches)
    are bound by arithmetic, where the BLAS GEMM on `dense` is faster, so both are kept.
    Subclasses hand over the kernel pair and the weight tensors it takes, in its order.
    """

    def __init__(self, shape: tuple[int, int], dense: torch.Tensor,
                 weights: tuple[torch.Tensor, ...], matmul, dequantize) -> None:
        self.out_features, self.in_features = shape
        if tuple(dense.shape) != tuple(shape):
            raise ValueError(f"dense weight {tuple(dense.shape)} does not match {tuple(shape)}")
        self.dense = dense
        self._weights = weights  # kept alive: the kernel reads them through raw pointers
        self._weight_ptrs = tuple(t.data_ptr() for t in weights)
        self._matmul, self._dequantize = matmul, dequantize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [rows, out] for a kernel step; `dense`'s dtype for a big one."""
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected a CPU input [rows, {self.in_features}], got "
                             f"{tuple(x.shape)} on {x.device.type}")
        rows = x.shape[0]
        if rows > KERNEL_MAX_ROWS:
            return F.linear(x.to(self.dense.dtype), self.dense)
        x = x.float().contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = self._matmul(x.data_ptr(), rows, self.in_features, *self._weight_ptrs,
                              self.out_features, y.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{type(self).__name__}: the kernel failed ({status})")
        return y

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] exactly as the kernel sees it."""
        out = torch.empty(self.out_features, self.in_features)
        status = self._dequantize(*self._weight_ptrs, self.out_features, self.in_features,
                                  out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{type(self).__name__}: the dequantize kernel failed ({status})")
        return out


class Q4_1Float32Linear(_QuantizedFloat32Linear):
    """Layer matmuls: Q4_1 codes, 5 bits per weight."""

    def __init__(self, q: Q4_1Weight, lib: ctypes.CDLL, dense: torch.Tensor) -> None:
        weights = (pack_codes(q.codes),  # [N, K/2] uint8
                   q.scales.contiguous(), q.minimums.contiguous())  # [N, K/32] float32 each
        super().__init__(tuple(q.codes.shape), dense, weights, lib.q4_1_matmul_f32,
                         lib.q4_1_dequantize_f32)


class Q8_0Float32Linear(_QuantizedFloat32Linear):
    """The vocab head, usually Q8_0: 8.5 bits per weight. Returns float32 logits for kernel
    steps whatever `dense`'s dtype (the executor wants float32 logits anyway)."""

    def __init__(self, q: Q8_0Weight, lib: ctypes.CDLL, dense: torch.Tensor) -> None:
        weights = (q.codes.contiguous(), q.scales.contiguous())  # [N, K] int8, [N, K/32] f32
        super().__init__(tuple(q.codes.shape), dense, weights, lib.q8_0_matmul_f32,
                         lib.q8_0_dequantize_f32)

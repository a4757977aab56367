"""Big steps' layers as bfloat16 GEMMs, on CPUs with bfloat16 in hardware (fast mode only).

A step of hundreds of tokens (prompt chunks; rarely, 128+ decodes) is GEMM-shaped. ONNX
Runtime's `MatMulNBits` runs it at ~240 GFLOP/s on 2 Zen 4 cores (int8 activations); oneDNN's
bfloat16 GEMM, through torch, at ~390 (AVX-512-BF16). So on such CPUs the fast mode runs a step
of at least `DENSE_PREFILL_TOKENS` tokens here: each layer's matrices are widened from the
GGUF's codes into one reusable bfloat16 buffer just before use (cpu_kernels/dequantize.cpp, a
few percent of the GEMM's time), and no dense copy of a weight outlives its layer. Norms, SwiGLU
and the residual stay float32; attention is the model's own (paged, in place).

Where bfloat16 is emulated (AVX2-only CPUs) the GEMM is slower than ONNX Runtime's, and the
exact mode keeps float32 activations, so neither uses this path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.executor.gguf_loader import LlamaConfig, NativeWeight, Q4_1Weight
from services.executor.model import rms_norm

# Steps of at least this many tokens take this path (2 Zen 4 cores: at 256 rows the layers'
# GEMMs take 149 ms in bfloat16 against ~270 ms in ONNX Runtime; at 64 rows widening the
# weights costs more than the GEMMs save).
DENSE_PREFILL_TOKENS = 128


@dataclass(frozen=True)
class QuantPart:
    """One quantized matrix [N, K] in the form the widening kernel reads."""

    kind: str  # "q4" or "q8"
    n: int
    k: int
    codes: torch.Tensor  # q4: packed [N, K/2] uint8 (even inputs in the low nibble); q8: [N, K]
    scales: torch.Tensor  # [N, K/32] float32
    mins: torch.Tensor | None = None  # q4 only

    @classmethod
    def of(cls, native: NativeWeight) -> QuantPart:
        if isinstance(native, Q4_1Weight):
            codes = native.codes.numpy()
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
            return cls("q4", *codes.shape, torch.from_numpy(np.ascontiguousarray(packed)),
                       native.scales.contiguous(), native.minimums.contiguous())
        return cls("q8", *native.codes.shape, native.codes.contiguous(),
                   native.scales.contiguous())


def widen(lib: ctypes.CDLL, parts: list[QuantPart], buffer: torch.Tensor,
          num_threads: int) -> torch.Tensor:
    """The row-stack of `parts` as bfloat16 [sum N, K], in the front of `buffer`."""
    k = parts[0].k
    out = buffer[:sum(q.n for q in parts) * k].view(-1, k)
    row = 0
    for q in parts:
        target = out[row:row + q.n]
        if q.kind == "q4":
            status = lib.q4_dequantize_bf16(q.codes.data_ptr(), q.scales.data_ptr(),
                                            q.mins.data_ptr(), q.n, q.k, target.data_ptr(),
                                            num_threads)
        else:
            status = lib.q8_0_dequantize_bf16(q.codes.data_ptr(), q.scales.data_ptr(), q.n,
                                              q.k, target.data_ptr(), num_threads)
        if status != 0:
            raise RuntimeError(f"widening a {q.kind} matrix [{q.n}, {q.k}] failed")
        row += q.n
    return out


class DensePrefill:
    """`__call__(hidden, attend)`: every layer on hidden [T, D] float32 -> the residual stream
    after the last layer (before the final norm). `attend(layer, qkv)` is the model's attention
    (RoPE, KV write, paged attention) of one layer: [T, (H + 2 Hkv) Dh] -> [T, H Dh].

    Only for files whose every layer matrix is Q4_0/Q4_1/Q8_0 (`covers`): a float matrix would
    need a bfloat16 copy kept beside ONNX Runtime's."""

    MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

    @classmethod
    def covers(cls, config: LlamaConfig, native: dict[str, NativeWeight]) -> bool:
        return all(f"blk.{i}.{m}.weight" in native
                   for i in range(config.num_layers) for m in cls.MATRICES)

    def __init__(self, config: LlamaConfig, dense: dict[str, torch.Tensor],
                 native: dict[str, NativeWeight], lib: ctypes.CDLL, num_threads: int) -> None:
        self.config, self.lib, self.num_threads = config, lib, num_threads

        def part(name: str) -> QuantPart:
            return QuantPart.of(native[name])

        self.matrices: list[dict[str, list[QuantPart]]] = []  # per layer
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []  # (attention's, FFN's)
        for i in range(config.num_layers):
            p = f"blk.{i}."
            self.matrices.append({
                "qkv": [part(p + f"attn_{n}.weight") for n in "qkv"],
                "o": [part(p + "attn_output.weight")],
                "gate_up": [part(p + "ffn_gate.weight"), part(p + "ffn_up.weight")],
                "down": [part(p + "ffn_down.weight")]})
            self.norms.append((dense[p + "attn_norm.weight"].float(),
                               dense[p + "ffn_norm.weight"].float()))
        largest = max(sum(q.n for q in parts) * parts[0].k
                      for layer in self.matrices for parts in layer.values())
        self._buffer = torch.empty(largest, dtype=torch.bfloat16)

    def linear(self, x: torch.Tensor, parts: list[QuantPart]) -> torch.Tensor:
        """x [T, K] float32 @ Wᵀ -> [T, N] float32, the GEMM in bfloat16."""
        weight = widen(self.lib, parts, self._buffer, self.num_threads)
        return F.linear(x.to(torch.bfloat16), weight).float()

    def __call__(self, hidden: torch.Tensor,
                 attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        layers = zip(self.matrices, self.norms, strict=True)
        for index, (m, (attn_norm, ffn_norm)) in enumerate(layers):
            qkv = self.linear(rms_norm(hidden, attn_norm, eps), m["qkv"])
            hidden = hidden + self.linear(attend(index, qkv), m["o"])
            gate, up = self.linear(rms_norm(hidden, ffn_norm, eps), m["gate_up"]).chunk(2, -1)
            hidden = hidden + self.linear(F.silu(gate) * up, m["down"])
        return hidden

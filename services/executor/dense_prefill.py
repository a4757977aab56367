"""Big steps' layers as bfloat16 GEMMs: the fast mode's prompt chunks on CPUs with AMX.

A step of hundreds of tokens (prompt chunks; rarely, 128+ decodes) is GEMM-shaped. Here each
layer's matrices are widened from the GGUF's codes into one reusable bfloat16 buffer just before
use (cpu_kernels/dequantize.cpp, a few percent of the GEMM's time), and oneDNN's bfloat16 GEMM,
through torch, multiplies; no dense copy of a weight outlives its layer. Norms, SwiGLU and the
residual stay float32; attention is the model's own (paged, in place).

Where the GEMM runs on vector units, llmbus's integer kernel (int_step.py) is as fast or faster
at every size a step takes (2 Zen 4 cores with AVX-512-BF16, the default model's 30 layers:
256 rows 151 against 196 ms, 512: 275 against 337, 1,024: 538 against 616, 2,048: 1,266 against
1,272), so the fast mode takes this path by default only where AMX's bfloat16 tiles run the GEMM
(expected many times faster there; not yet measured against the integer kernel on such a CPU).
It is also the more exact of the two (perplexity 16.522 against the exact mode's 16.525; the
integer kernel's 16.643).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmbus.services.executor.gguf_loader import LlamaConfig
from llmbus.services.executor.model import rms_norm
from llmbus.services.executor.quant_parts import LayerParts, QuantPart

# Steps of at least this many tokens take this path where it is on (2 Zen 4 cores: at 64 rows
# widening the weights costs more than the GEMMs save).
DENSE_PREFILL_TOKENS = 128


def widen(lib: ctypes.CDLL, parts: list[QuantPart], buffer: torch.Tensor,
          num_threads: int) -> torch.Tensor:
    """The row-stack of `parts` as bfloat16 [sum N, K], in the front of `buffer`."""
    k = parts[0].k
    out = buffer[:sum(q.n for q in parts) * k].view(-1, k)
    row = 0
    for q in parts:
        target = out[row:row + q.n]
        if q.kind == "q4":
            scales, mins = q.block_scales()  # multiplied out for a factored Q4_K part
            status = lib.q4_dequantize_bf16(q.codes.data_ptr(), scales.data_ptr(),
                                            mins.data_ptr(), q.n, q.k, target.data_ptr(),
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

    Only for files whose every layer matrix is quantized (`quant_parts.covers`): a float
    matrix would need a bfloat16 copy kept beside ONNX Runtime's."""

    def __init__(self, config: LlamaConfig, dense: dict[str, torch.Tensor],
                 layers: list[LayerParts], lib: ctypes.CDLL, num_threads: int) -> None:
        self.config, self.lib, self.num_threads = config, lib, num_threads
        self.matrices = layers
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = [  # (attention's, FFN's)
            (dense[f"blk.{i}.attn_norm.weight"].float(), dense[f"blk.{i}.ffn_norm.weight"].float())
            for i in range(config.num_layers)]
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

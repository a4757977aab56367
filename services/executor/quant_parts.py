"""The GGUF's quantized layer matrices in the one form llmbus's CPU kernels read.

Both CPU paths beside ONNX Runtime take a layer's matrices from here: big steps widen them to
bfloat16 for a GEMM (dense_prefill.py), small steps multiply them with int8 activations
(small_step.py). One copy serves both, so neither keeps weights of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.executor.gguf_loader import LlamaConfig, NativeWeight, Q4_1Weight

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class QuantPart:
    """One quantized matrix [N, K], blocks of 32 along K."""

    kind: str  # "q4" (Q4_1, and Q4_0 in Q4_1 form) or "q8" (Q8_0)
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


# One layer's matrices grouped as its matmuls take them: "qkv" (q, k, v), "o", "gate_up"
# (gate, up) and "down", each a row-stack of parts.
LayerParts = dict[str, list[QuantPart]]


def covers(config: LlamaConfig, native: dict[str, NativeWeight]) -> bool:
    """Whether every layer matrix of the file is quantized (Q4_0/Q4_1/Q8_0)."""
    return all(f"blk.{i}.{m}.weight" in native
               for i in range(config.num_layers) for m in LAYER_MATRICES)


def layer_parts(config: LlamaConfig, native: dict[str, NativeWeight]) -> list[LayerParts]:
    """Every layer's matrices (the file must be `covers`ed)."""

    def part(name: str) -> QuantPart:
        return QuantPart.of(native[name])

    return [{"qkv": [part(f"blk.{i}.attn_{n}.weight") for n in "qkv"],
             "o": [part(f"blk.{i}.attn_output.weight")],
             "gate_up": [part(f"blk.{i}.ffn_gate.weight"), part(f"blk.{i}.ffn_up.weight")],
             "down": [part(f"blk.{i}.ffn_down.weight")]}
            for i in range(config.num_layers)]

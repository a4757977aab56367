"""The GGUF's quantized layer matrices in the one form llmbus's CPU kernels read.

Both CPU paths beside ONNX Runtime take a layer's matrices from here: the integer kernel
multiplies them with integer activations (int_step.py), and big steps on AMX CPUs widen them to
bfloat16 for a GEMM (dense_prefill.py). One copy serves both, so neither keeps weights of its
own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmbus.services.executor.gguf_loader import LlamaConfig
from llmbus.services.executor.gguf_quants import QUANT_GROUP, NativeWeight, Q4_1Weight

COLUMNS = 8  # output columns per column group: one 8-lane vector of the kernels
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class QuantPart:
    """One quantized matrix [N, K], N a multiple of 8, blocks of 32 along K, tiled for the
    kernels: column group c holds output columns 8c .. 8c + 7, block by block, so that each
    32-bit lane of a 32-byte load is one column's four consecutive codes (the layouts are
    spelled out in cpu_kernels/int_step.cpp)."""

    kind: str  # "q4" (Q4_1, and Q4_0 in Q4_1 form) or "q8" (Q8_0)
    n: int
    k: int
    codes: torch.Tensor  # q4: [N/8, K/32, 4, 32] uint8 (two codes a byte); q8: [N/8, K/32, 8, 32]
    scales: torch.Tensor  # [N/8, K/32, 8] float32
    mins: torch.Tensor | None = None  # q4 only, as scales

    @classmethod
    def of(cls, native: NativeWeight | QuantPart) -> QuantPart:
        if isinstance(native, QuantPart):  # tiled as it was loaded
            return native
        n, k = native.codes.shape
        if n % COLUMNS or k % QUANT_GROUP:
            raise ValueError(f"a [{n}, {k}] matrix: the kernels take N % {COLUMNS} == 0 and "
                             f"K % {QUANT_GROUP} == 0")
        groups, blocks = n // COLUMNS, k // QUANT_GROUP
        codes = native.codes.numpy()
        if isinstance(native, Q4_1Weight):
            # k = 32 g + 8 h + 4 half + i; the byte of (h, j, i) holds half 0 low, half 1 high
            c = codes.reshape(groups, COLUMNS, blocks, 4, 2, 4)
            packed = (c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)
            tiled = packed.reshape(groups, blocks, 4, 32)
            return cls("q4", n, k, torch.from_numpy(np.ascontiguousarray(tiled)),
                       _tile_scales(native.scales), _tile_scales(native.minimums))
        c = codes.reshape(groups, COLUMNS, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
        return cls("q8", n, k, torch.from_numpy(np.ascontiguousarray(c.reshape(groups, blocks,
                                                                                 8, 32))),
                   _tile_scales(native.scales))


def _tile_scales(per_block: torch.Tensor) -> torch.Tensor:
    """[N, K/32] -> [N/8, K/32, 8]."""
    n, blocks = per_block.shape
    return per_block.float().reshape(n // COLUMNS, COLUMNS, blocks).transpose(1, 2).contiguous()


# One layer's matrices grouped as its matmuls take them: "qkv" (q, k, v), "o", "gate_up"
# (gate, up) and "down", each a row-stack of parts.
LayerParts = dict[str, list[QuantPart]]


def rows(weight: NativeWeight | QuantPart) -> int:
    return weight.n if isinstance(weight, QuantPart) else weight.codes.shape[0]


def covers(config: LlamaConfig, native: dict[str, NativeWeight | QuantPart]) -> bool:
    """Whether every layer matrix of the file is quantized in a shape the kernels tile (N a
    multiple of 8)."""
    names = [f"blk.{i}.{m}.weight" for i in range(config.num_layers) for m in LAYER_MATRICES]
    return all(n in native and rows(native[n]) % COLUMNS == 0 for n in names)


def kernel_takes(config: LlamaConfig, native: dict[str, NativeWeight | QuantPart]) -> bool:
    """Whether the integer kernel can run every matmul of the file, the vocabulary head too."""
    return (covers(config, native) and "output.weight" in native
            and rows(native["output.weight"]) % COLUMNS == 0)


def tile_as_loaded(name: str, weight: NativeWeight) -> NativeWeight | QuantPart:
    """A load-time transform (gguf_loader.load_gguf): layer matrices and an untied vocabulary
    head go straight into the kernels' form, so the load never holds every matrix twice. The
    embedding table keeps its form (rows are looked up from it)."""
    matmul = name == "output.weight" or (name.startswith("blk.") and any(
        name.endswith(f".{m}.weight") for m in LAYER_MATRICES))
    return QuantPart.of(weight) if matmul and rows(weight) % COLUMNS == 0 else weight


def layer_parts(config: LlamaConfig, native: dict[str, NativeWeight],
                release: bool = False) -> list[LayerParts]:
    """Every layer's matrices (the file must be `covers`ed). With `release`, each matrix
    leaves `native` once tiled, so that the load never holds both forms of every weight."""

    def part(name: str) -> QuantPart:
        return QuantPart.of(native.pop(name) if release else native[name])

    return [{"qkv": [part(f"blk.{i}.attn_{n}.weight") for n in "qkv"],
             "o": [part(f"blk.{i}.attn_output.weight")],
             "gate_up": [part(f"blk.{i}.ffn_gate.weight"), part(f"blk.{i}.ffn_up.weight")],
             "down": [part(f"blk.{i}.ffn_down.weight")]}
            for i in range(config.num_layers)]

"""The GGUF's quantized layer matrices in the form llmbus's integer kernel reads
(backends/int_step.py, kernels/cpu/int_step.cpp), and whether a file can be read so at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmbus.services.executor.weights.gguf_quants import (
    QUANT_GROUP,
    NativeWeight,
    Q4_1Weight,
)
from llmbus.services.executor.weights.k_quants import CHUNK_ROWS, KQuantWeight, tile_planes
from llmbus.services.executor.weights.matrices import COLUMNS, LAYER_MATRICES, expert_matrix
from llmbus.services.executor.weights.model_config import LlamaConfig

_GROUPS_AT_ONCE = 128  # column groups tiled in place at a time (a copy of 128 slabs)


@dataclass(frozen=True)
class QuantPart:
    """One quantized matrix [N, K], N a multiple of 8, blocks of 32 along K, tiled for the
    kernels: column group c holds output columns 8c .. 8c + 7, block by block, so that each
    32-bit lane of a 32-byte load is one column's four consecutive codes (the layouts are
    spelled out in kernels/cpu/int_step.cpp)."""

    kind: str  # "q4" (Q4_1, and Q4_0 and Q4_K in Q4_1 form), "q8" (Q8_0), "kq" (k_quants.py)
    n: int
    k: int
    # q4: [N/8, K/32, 4, 32] uint8 (two codes a byte); q8: [N/8, K/32, 8, 32]; kq: the low
    # plane [N/8, K/32, low_bits, 32] (k_quants.tile_planes)
    codes: torch.Tensor
    scales: torch.Tensor  # [N/8, K/32, 8] float32; with sub_scales [N/8, K/256, 8]
    mins: torch.Tensor | None = None  # q4 only, as scales (kq: -dmin, as its scales)
    # Q4_K kept factored: a block's scale is its super-block's times these (see KFactors);
    # kq: one a sub-block (kernels/cpu/k_quant_tiles.h)
    sub_scales: torch.Tensor | None = None  # [N/8, K/32, 8] uint8
    sub_mins: torch.Tensor | None = None
    high_codes: torch.Tensor | None = None  # kq: the high plane, if its format has one
    format: str = ""  # kq: a key of k_quants.FORMATS

    @classmethod
    def of(cls, native: NativeWeight | KQuantWeight | QuantPart | PackedRows,
           consume: bool = False) -> QuantPart:
        """The tiled form of `native`. With `consume` (nothing else holds `native`), 8-bit
        codes are tiled in their own memory, so that tiling a big matrix (a vocabulary head)
        never holds it twice."""
        if isinstance(native, QuantPart):  # tiled as it was loaded
            return native
        if isinstance(native, PackedRows):  # a tied embedding, also the vocabulary head
            native = native.unpacked()
        n, k = native.shape if isinstance(native, KQuantWeight) else native.codes.shape
        if n % COLUMNS or k % QUANT_GROUP:
            raise ValueError(f"a [{n}, {k}] matrix: the kernels take N % {COLUMNS} == 0 and "
                             f"K % {QUANT_GROUP} == 0")
        groups, blocks = n // COLUMNS, k // QUANT_GROUP
        if isinstance(native, KQuantWeight):
            return _tiled_k_quant(native)
        codes = native.codes.numpy()
        if isinstance(native, Q4_1Weight):
            # k = 32 g + 8 h + 4 half + i; the byte of (h, j, i) holds half 0 low, half 1 high
            c = codes.reshape(groups, COLUMNS, blocks, 4, 2, 4)
            packed = (c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)
            tiled = torch.from_numpy(np.ascontiguousarray(packed.reshape(groups, blocks, 4, 32)))
            f = native.k_factors
            if f is not None:
                return cls("q4", n, k, tiled, _tile_scales(f.d), _tile_scales(f.neg_dmin),
                           _tile_scales(f.scales), _tile_scales(f.mins))
            return cls("q4", n, k, tiled, _tile_scales(native.scales),
                       _tile_scales(native.minimums))
        c = codes.reshape(groups, COLUMNS, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
        if consume and native.codes.is_contiguous():  # group g's slab: the same bytes after
            tiled = codes.reshape(groups, blocks, 8, COLUMNS, 4)
            for first in range(0, groups, _GROUPS_AT_ONCE):
                tiled[first:first + _GROUPS_AT_ONCE] = c[first:first + _GROUPS_AT_ONCE]
            return cls("q8", n, k, native.codes.view(groups, blocks, 8, 32),
                       _tile_scales(native.scales))
        return cls("q8", n, k, torch.from_numpy(np.ascontiguousarray(c.reshape(groups, blocks,
                                                                                 8, 32))),
                   _tile_scales(native.scales))


@dataclass(frozen=True)
class PackedRows:
    """A 4-bit embedding table as its rows are looked up: two codes a byte (the loaded form
    has one), so a table of V x D weights holds 0.75 D bytes a row, not 1.25 D.
    Byte i of a row holds code 2i in its low nibble and code 2i + 1 in its high one."""

    codes: torch.Tensor  # [V, D/2] uint8
    scales: torch.Tensor  # [V, D/32] float32
    minimums: torch.Tensor  # [V, D/32] float32

    @classmethod
    def of(cls, weight: Q4_1Weight) -> PackedRows:
        codes = weight.codes
        return cls(codes[:, 0::2] | (codes[:, 1::2] << 4), weight.scales, weight.minimums)

    def _codes(self, packed: torch.Tensor) -> torch.Tensor:
        """[T, D/2] packed -> [T, D] uint8."""
        return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> their rows [T, D] float32, as Q4_1Weight.dequantize computes them."""
        codes = self._codes(self.codes[ids]).view(len(ids), -1, QUANT_GROUP).float()
        rows = codes * self.scales[ids][..., None] + self.minimums[ids][..., None]
        return rows.view(len(ids), -1)

    def unpacked(self) -> Q4_1Weight:
        return Q4_1Weight(self._codes(self.codes), self.scales, self.minimums)


def _tiled_k_quant(weight: KQuantWeight) -> QuantPart:
    """A K-quant's planes and scales, tiled CHUNK_ROWS rows at a time from its blocks (so a
    vocabulary head never has all its codes unpacked at once); Q2_K's scale and minimum of a
    sub-block in one byte (low and high nibble), as its file packs them."""
    f = weight.spec
    n, k = weight.shape
    tiles: dict[str, torch.Tensor] = {}
    for first in range(0, n, CHUNK_ROWS):
        rows = weight.unpacked(slice(first, first + CHUNK_ROWS))
        sub_scales, sub_mins = rows.sub_scales, rows.sub_mins
        if weight.format == "Q2_K":
            assert sub_scales is not None and sub_mins is not None
            sub_scales = sub_scales.view(torch.uint8) | (sub_mins.view(torch.uint8) << 4)
            sub_mins = None
        chunk = dict(zip(("codes", "high_codes"), tile_planes(
            rows.codes, f.low_bits, f.high_bits, COLUMNS), strict=False))
        chunk |= {name: _tile_scales(t) for name, t in (
            ("scales", rows.d), ("mins", rows.neg_dmin), ("sub_scales", sub_scales),
            ("sub_mins", sub_mins)) if t is not None}
        for name, tile in chunk.items():
            if name not in tiles:
                tiles[name] = torch.empty((n // COLUMNS, *tile.shape[1:]), dtype=tile.dtype)
            tiles[name][first // COLUMNS:first // COLUMNS + len(tile)] = tile
    return QuantPart("kq", n, k, format=weight.format, **tiles)


def _tile_scales(per_block: torch.Tensor) -> torch.Tensor:
    """[N, B] -> [N/8, B, 8] (float32 stays float32, integer sub-scales keep their type)."""
    n, blocks = per_block.shape
    if per_block.dtype not in (torch.uint8, torch.int8):
        per_block = per_block.float()
    return per_block.reshape(n // COLUMNS, COLUMNS, blocks).transpose(1, 2).contiguous()


# One layer's matrices grouped as its matmuls take them: "qkv" (q, k, v), "o", "gate_up"
# (gate, up) and "down", each a row-stack of parts.
LayerParts = dict[str, list[QuantPart]]


def rows(weight: NativeWeight | QuantPart | PackedRows) -> int:
    if isinstance(weight, QuantPart):
        return weight.n
    return weight.shape[0] if isinstance(weight, KQuantWeight) else weight.codes.shape[0]


def covers(config: LlamaConfig, native: dict[str, NativeWeight | QuantPart]) -> bool:
    """Whether every layer matrix of the file is quantized in a shape the kernels tile (N a
    multiple of 8)."""
    return all(n in native and rows(native[n]) % COLUMNS == 0 for n in layer_matrices(config))


def layer_matrices(config: LlamaConfig) -> list[str]:
    """The names of every layer's matrices as loaded: a mixture of experts' split per expert."""
    if not config.num_experts:
        return [f"blk.{i}.{m}.weight" for i in range(config.num_layers) for m in LAYER_MATRICES]
    return [name for i in range(config.num_layers) for name in (
        *(f"blk.{i}.{m}.weight" for m in ("attn_q", "attn_k", "attn_v", "attn_output")),
        *(expert_matrix(f"blk.{i}.ffn_{m}_exps.weight", e) for m in ("gate", "up", "down")
          for e in range(config.num_experts)))]


def kernel_takes(config: LlamaConfig, native: dict[str, NativeWeight | QuantPart]) -> bool:
    """Whether the integer kernel can run every matmul of the file, the vocabulary head too,
    in its layer's shape (llama's: not Gemma 3's norms after the attention and the MLP). A
    layer shard (layer_slice.py) has no head."""
    head_taken = not config.has_vocab or ("output.weight" in native
                                          and rows(native["output.weight"]) % COLUMNS == 0)
    return not config.post_norms and not config.gelu and covers(config, native) and head_taken


def tile_as_loaded(name: str, weight: NativeWeight) -> NativeWeight | QuantPart | PackedRows:
    """A load-time transform (gguf_loader.load_gguf): layer matrices and an untied vocabulary
    head go straight into the kernels' form, so the load never holds every matrix twice. A
    4-bit embedding table packs its codes two a byte (rows are looked up from it; a tied head
    is tiled from it)."""
    matmul = name == "output.weight" or (name.startswith("blk.") and (any(
        name.endswith(f".{m}.weight") for m in LAYER_MATRICES) or "_exps." in name))
    if name == "token_embd.weight" and isinstance(weight, Q4_1Weight):
        return PackedRows.of(weight)
    if matmul and rows(weight) % COLUMNS == 0:
        return QuantPart.of(weight, consume=True)  # the loader keeps only what this returns
    return weight


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

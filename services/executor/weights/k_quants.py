"""K-quants with 16-weight sub-blocks (Q3_K, Q6_K) kept at the file's bits, for the integer
kernel (kernels/cpu/int_step.cpp, kind KQ).

Both are, per super-block of 256 weights, a float16 d and 16 signed sub-block scales, and per
weight a small signed integer: w = d * scale * q. Q6_K's q is 6 bits (-32..31), its scales
int8; Q3_K's q is 3 bits (-4..3), its scales 6 bits (-32..31). Q4_1-style scales per 32 would
need two floats per 16 weights and a Q8_0 copy 8.5 bits a weight (what the fast mode used to
make of Q6_K, 1.3x the bytes); here each weight keeps its bits, split into two bit planes
(Q6_K: 4 + 2, Q3_K: 2 + 1), and the kernel puts them together as it goes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

SUPER_BLOCK = 256
SUB_BLOCK = 16
# Per type: (bytes a block, bits of the low plane, bits of the high plane)
LAYOUTS = {"Q6_K": (210, 4, 2), "Q3_K": (110, 2, 1)}


@dataclass(frozen=True)
class KQuantWeight:
    """A Q3_K or Q6_K matrix [out, in]: weight = d * sub_scale * value."""

    values: torch.Tensor  # [out, in] int8: -32..31 (Q6_K), -4..3 (Q3_K)
    sub_scales: torch.Tensor  # [out, in / 16] int8
    d: torch.Tensor  # [out, in / 256] float32 (float16 values)
    low_bits: int  # how the kernel stores value + 2^(bits - 1): a plane of these bits...
    high_bits: int  # ... and one of these

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KQuantWeight:
        return KQuantWeight(fn(self.values), fn(self.sub_scales), fn(self.d), self.low_bits,
                            self.high_bits)

    def block_scales(self) -> torch.Tensor:
        """[out, in / 16] float32: d * scale, the one float32 product the kernel makes."""
        return self.d.repeat_interleave(SUPER_BLOCK // SUB_BLOCK, dim=1) * self.sub_scales.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> their rows [T, D] float32 (an embedding table's lookup)."""
        values = self.values[ids].float().view(len(ids), -1, SUB_BLOCK)
        scales = self.d[ids].repeat_interleave(SUPER_BLOCK // SUB_BLOCK, dim=1) \
            * self.sub_scales[ids].float()
        return (values * scales[..., None]).view(len(ids), -1)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], as llama.cpp and gguf-py compute it."""
        out, inp = self.values.shape
        values = self.values.float().view(out, inp // SUB_BLOCK, SUB_BLOCK)
        return (values * self.block_scales()[..., None]).view(out, inp)


CHUNK_ROWS = 1024  # rows unpacked at a time: a vocabulary head's temporaries stay a few MiB


def _parse(raw: np.ndarray, shape: tuple[int, int], kind: str,
           unpack: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
           ) -> KQuantWeight:
    """`unpack(blocks)` -> (values [n, 256], scales [n, 16], d [n, 1]) for `n` blocks, run on
    CHUNK_ROWS rows at a time into the weight's own tensors."""
    out, inp = shape
    if inp % SUPER_BLOCK:
        raise ValueError(f"{kind}: {inp} inputs are not whole super-blocks of {SUPER_BLOCK}")
    block_bytes, low, high = LAYOUTS[kind]
    rows = np.ascontiguousarray(raw).reshape(out, (inp // SUPER_BLOCK) * block_bytes)
    weight = KQuantWeight(torch.empty(out, inp, dtype=torch.int8),
                          torch.empty(out, inp // SUB_BLOCK, dtype=torch.int8),
                          torch.empty(out, inp // SUPER_BLOCK), low, high)
    for first in range(0, out, CHUNK_ROWS):
        chunk = rows[first:first + CHUNK_ROWS]
        values, scales, d = unpack(chunk.reshape(-1, block_bytes))
        n = len(chunk)
        weight.values[first:first + n] = torch.from_numpy(values.astype(np.int8).reshape(n, inp))
        weight.sub_scales[first:first + n] = torch.from_numpy(
            scales.astype(np.int8).reshape(n, -1))
        weight.d[first:first + n] = torch.from_numpy(d.astype(np.float32).reshape(n, -1))
    return weight


def parse_q6_k(raw: np.ndarray, shape: tuple[int, int]) -> KQuantWeight:
    """Q6_K's 210-byte blocks: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    float16 d. Weight 128h + 32j + i (h < 2, j < 4, i < 32) has its low nibble in byte
    64h + 32(j % 2) + i (low half for j < 2, high half else) and its high pair at bits 2j of
    byte 128 + 32h + i; its value is those 6 bits less 32."""
    return _parse(raw, shape, "Q6_K", _unpack_q6_k)


def _unpack_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(blocks)
    ql = blocks[:, :128].reshape(n, 2, 2, 32)  # [block, h, j % 2, i]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)  # [block, h, -, i]
    low = np.stack([ql & 0xF, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # j = 2 * half + (j % 2)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    values = (low | (high << 4)).astype(np.int16) - 32
    return values, blocks[:, 192:208].view(np.int8), blocks[:, 208:210].copy().view(np.float16)


def parse_q3_k(raw: np.ndarray, shape: tuple[int, int]) -> KQuantWeight:
    """Q3_K's 110-byte blocks: 32 bytes of high bits, 64 of low bit pairs, 12 bytes of 6-bit
    scales, float16 d. Weight 128h + 32j + i has its pair at bits 2j of byte 32 + 32h + i and
    its high bit at bit 4h + j of byte i; the value is the pair, less 4 where that bit is 0.
    Scale s (0..15) is the low or high nibble (s < 8, else) of byte 96 + s % 8 with bits
    2(s // 4) of byte 104 + s % 4 above it, less 32."""
    return _parse(raw, shape, "Q3_K", _unpack_q3_k)


def _unpack_q3_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(blocks)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    pairs = (blocks[:, 32:96].reshape(n, 2, 1, 32) >> shifts) & 3  # [block, h, j, i]
    bits = (blocks[:, None, None, :32] >> (4 * np.arange(2, dtype=np.uint8)[None, :, None, None]
                                           + shifts // 2)) & 1
    values = pairs.astype(np.int16) - 4 * (1 - bits.astype(np.int16))
    packed = blocks[:, 96:108]
    low = np.concatenate([packed[:, :8] & 0xF, packed[:, :8] >> 4], axis=1)  # [block, s]
    high = (packed[:, 8:12][:, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3
    scales = (low | (high.reshape(n, 16) << 4)).astype(np.int16) - 32
    return values, scales, blocks[:, 108:110].copy().view(np.float16)


def tile_planes(values: torch.Tensor, low_bits: int, high_bits: int,
                columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] values -> the kernel's two planes of value + 2^(bits - 1), per column group of
    `columns` and block of 32 inputs: each eighth e of a block (inputs 4e .. 4e + 3 of the 8
    columns, byte 4j + i: column j's input 4e + i, as Q8_0's tiles) is a 32-byte vector of
    codes; a plane of b bits packs 8 / b such vectors into each of its b vectors a block,
    eighth e in vector e // (8 / b), at bits b * (e % (8 / b)). [N/8, K/32, b, 32] uint8 each,
    tiled CHUNK_ROWS rows at a time."""
    n, k = values.shape
    groups, blocks = n // columns, k // 32
    planes = [torch.empty(groups, blocks, bits, 32, dtype=torch.uint8)
              for bits in (low_bits, high_bits)]
    step = max(1, CHUNK_ROWS // columns)
    for first in range(0, groups, step):
        chunk = values[first * columns:(first + step) * columns].numpy()
        codes = (chunk.astype(np.int16) + (1 << (low_bits + high_bits - 1))).astype(np.uint8)
        count = len(codes) // columns
        eighths = codes.reshape(count, columns, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
        eighths = eighths.reshape(count, blocks, 8, 32)  # [group, block, e, byte]
        for plane, shift, bits in ((planes[0], 0, low_bits), (planes[1], low_bits, high_bits)):
            per = 8 // bits
            part = ((eighths >> shift) & ((1 << bits) - 1)).reshape(count, blocks, bits, per, 32)
            packed = np.zeros((count, blocks, bits, 32), dtype=np.uint8)
            for s in range(per):
                packed |= part[:, :, :, s] << (bits * s)
            plane[first:first + count] = torch.from_numpy(packed)
    return planes[0], planes[1]

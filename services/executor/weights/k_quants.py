"""The K-quant and IQ4 formats kept at the file's bits, for the integer kernel's kind KQ
(kernels/cpu/k_quant_tiles.h): Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS.

Each weight is a small code and its block's scales: w = d * sub_scale * value (- dmin * sub_min
for Q2_K and Q5_K), with d a float16 per super-block of 256 (IQ4_NL: per block of 32, and no
sub-scale) and the sub-scales small integers per 16 or 32 weights. Converting them to Q4_1's
float per 32 or to a Q8_0 copy costs bits (Q6_K as Q8_0 was 1.37x its bytes; Q2_K and Q3_K
loaded dense float32, 9-12x), so the codes keep their bits, split into two bit planes (Q6_K
4 + 2 bits, Q5_K 4 + 1, Q3_K 2 + 1, Q2_K 2, IQ4 4), and the scales their integers; the kernel
puts them together as it goes. `FORMATS` says, per format, what the kernel's Spec says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

SUB_BLOCK = 16


@dataclass(frozen=True)
class Format:
    kernel_id: int  # k_quant_tiles.h's Format
    block_bytes: int
    block_weights: int  # weights a block of the file (super-block, or IQ4_NL's 32)
    low_bits: int
    high_bits: int
    sub: int  # weights a sub-scale
    offset: int = 0  # value = code - offset
    mins: bool = False  # a minimum per sub-block (then codes are the values)
    codebook: bool = False  # value = IQ4_VALUES[code]


FORMATS = {
    "Q6_K": Format(1, 210, 256, 4, 2, 16, offset=32),
    "Q3_K": Format(2, 110, 256, 2, 1, 16, offset=4),
    "Q5_K": Format(3, 176, 256, 4, 1, 32, mins=True),
    "Q2_K": Format(4, 84, 256, 2, 0, 16, mins=True),
    "IQ4_NL": Format(5, 18, 32, 4, 0, 32, codebook=True),
    "IQ4_XS": Format(6, 136, 256, 4, 0, 32, codebook=True),
}
# IQ4's non-linear 16 values, as llama.cpp defines them (kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int8)
CHUNK_ROWS = 1024  # rows unpacked at a time: a vocabulary head's temporaries stay a few MiB


@dataclass(frozen=True)
class Unpacked:
    """Some rows of a K-quant matrix unpacked: codes and integer scales, row-major."""

    format: str  # a key of FORMATS
    codes: torch.Tensor  # [rows, in] uint8: the stored code (see Format)
    d: torch.Tensor  # [rows, in / block_weights] float32 (float16 values)
    sub_scales: torch.Tensor | None  # [rows, in / sub] int8 (Q2_K, Q5_K: 0..15, 0..63)
    neg_dmin: torch.Tensor | None = None  # [rows, in / 256] float32: -dmin (Q2_K, Q5_K)
    sub_mins: torch.Tensor | None = None  # [rows, in / sub] int8 (Q2_K, Q5_K)

    def values(self) -> torch.Tensor:
        """The integers the codes stand for, float32."""
        f = FORMATS[self.format]
        if f.codebook:
            return torch.from_numpy(IQ4_VALUES)[self.codes.long()].float()
        return self.codes.float() - f.offset

    def _per_weight(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.codes.shape[1] // t.shape[1], dim=1)

    def weights(self) -> torch.Tensor:
        """float32 [rows, in], as llama.cpp and gguf-py compute them: d * sub_scale first (one
        float32 product), times the value, then -dmin * sub_min added."""
        scale = self._per_weight(self.d)
        if self.sub_scales is not None:
            scale = scale * self._per_weight(self.sub_scales).float()
        weights = scale * self.values()
        if self.neg_dmin is not None and self.sub_mins is not None:
            weights = weights + self._per_weight(self.neg_dmin) * self._per_weight(
                self.sub_mins).float()
        return weights


@dataclass(frozen=True)
class KQuantWeight:
    """A K-quant or IQ4 matrix [out, in] as the file holds it: its blocks, a row of them per
    output (so rows can be permuted and cut), unpacked only a chunk of rows at a time, as the
    kernel's tiles are made (quant_parts) or an embedding's rows are looked up."""

    format: str  # a key of FORMATS
    blocks: torch.Tensor  # [out, bytes a row] uint8: the file's bytes
    inputs: int  # in

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.inputs

    @property
    def spec(self) -> Format:
        return FORMATS[self.format]

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KQuantWeight:
        return KQuantWeight(self.format, fn(self.blocks), self.inputs)

    def unpacked(self, rows: torch.Tensor | slice) -> Unpacked:
        """Those rows unpacked (a slice, or [T] row ids)."""
        f = FORMATS[self.format]
        chosen = self.blocks[rows].numpy()
        n = len(chosen)
        parts = _UNPACK[self.format](chosen.reshape(-1, f.block_bytes))
        codes, d, scales, neg_dmin, mins = (
            None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))
            for a in parts)
        assert codes is not None and d is not None
        return Unpacked(self.format, codes.to(torch.uint8), d, scales, neg_dmin, mins)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> their rows [T, in] float32 (an embedding table's lookup)."""
        return self.unpacked(ids).weights()

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], CHUNK_ROWS rows unpacked at a time."""
        return torch.cat([self.unpacked(slice(first, first + CHUNK_ROWS)).weights()
                          for first in range(0, self.shape[0], CHUNK_ROWS)])


def k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit sub-block scales and minimums [..., 12] -> two
    [..., 8] uint8 arrays: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (minimums); 4-7 in the nibbles of bytes 8-11, their top 2 bits in the top bits of 0-7."""
    p = packed.astype(np.uint16)
    scales = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)],
                            axis=-1)
    mins = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)],
                          axis=-1)
    return scales.astype(np.uint8), mins.astype(np.uint8)


def _float16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


# One chunk of blocks -> (codes [n, weights], d [n, 1], sub_scales [n, s] or None,
# -dmin [n, 1] or None, sub_mins [n, s] or None)
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]
SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]


def _unpack_q6_k(b: np.ndarray) -> Arrays:
    """210 bytes: 128 of low nibbles, 64 of high bit pairs, 16 int8 scales, float16 d. Weight
    128h + 32j + i (h < 2, j < 4, i < 32): its low nibble in byte 64h + 32(j % 2) + i (the low
    half for j < 2), its high pair at bits 2j of byte 128 + 32h + i."""
    n = len(b)
    ql = b[:, :128].reshape(n, 2, 2, 32)
    low = np.stack([ql & 0xF, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> SHIFTS) & 3
    return low | (high << 4), _float16(b, 208), b[:, 192:208].view(np.int8), None, None


def _unpack_q3_k(b: np.ndarray) -> Arrays:
    """110 bytes: 32 of high bits, 64 of low bit pairs, 12 of 6-bit scales, float16 d. Weight
    128h + 32j + i: its pair at bits 2j of byte 32 + 32h + i, its high bit at bit 4h + j of
    byte i; value = pair - 4 where that bit is 0 (code = pair + 4 * bit). Scale s is the low
    (s < 8) or high nibble of byte 96 + s % 8 with bits 2(s // 4) of byte 104 + s % 4 above
    it, less 32."""
    n = len(b)
    pairs = (b[:, 32:96].reshape(n, 2, 1, 32) >> SHIFTS) & 3
    bits = (b[:, None, None, :32] >> (4 * np.arange(2, dtype=np.uint8)[None, :, None, None]
                                      + SHIFTS // 2)) & 1
    packed = b[:, 96:108]
    low = np.concatenate([packed[:, :8] & 0xF, packed[:, :8] >> 4], axis=1)
    high = (packed[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3
    scales = (low | (high.reshape(n, 16) << 4)).astype(np.int16) - 32
    return pairs | (bits << 2), _float16(b, 108), scales.astype(np.int8), None, None


def _unpack_q5_k(b: np.ndarray) -> Arrays:
    """176 bytes: float16 d and dmin, Q4_K's 12 bytes of scales and minimums, 32 bytes of high
    bits, 128 of low nibbles. Weight 32s + i: its nibble in byte 48 + 32(s // 2) + i (low for
    even s), its high bit at bit s of byte 16 + i."""
    n = len(b)
    scales, mins = k_scales_and_mins(b[:, 4:16])
    runs = b[:, 48:176].reshape(n, 4, 1, 32)
    low = np.concatenate([runs & 0xF, runs >> 4], axis=2).reshape(n, 8, 32)
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4), _float16(b, 0), scales.astype(np.int8), -_float16(b, 2),
            mins.astype(np.int8))


def _unpack_q2_k(b: np.ndarray) -> Arrays:
    """84 bytes: 16 of (scale | min << 4) per 16 weights, 64 of bit pairs, float16 d and
    dmin. Weight 128h + 32j + i: its pair at bits 2j of byte 16 + 32h + i."""
    n = len(b)
    pairs = (b[:, 16:80].reshape(n, 2, 1, 32) >> SHIFTS) & 3
    scales = b[:, :16]
    return (pairs, _float16(b, 80), (scales & 0xF).astype(np.int8), -_float16(b, 82),
            (scales >> 4).astype(np.int8))


def _nibble_halves(qs: np.ndarray) -> np.ndarray:
    """IQ4's 16 bytes a block of 32: weight i < 16 in byte i's low nibble, 16 + i its high."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _unpack_iq4_nl(b: np.ndarray) -> Arrays:
    """18 bytes: float16 d, then 16 bytes of 4-bit codebook indices."""
    return _nibble_halves(b[:, 2:18]), _float16(b, 0), None, None, None


def _unpack_iq4_xs(b: np.ndarray) -> Arrays:
    """136 bytes: float16 d, uint16 of the scales' high bit pairs, 4 bytes of their low
    nibbles, 8 runs of 16 bytes of indices (one block of 32 each). Scale s (0..7): the
    nibble s % 2 of byte 4 + s // 2, with bits 2s of the uint16 above it, less 32."""
    n = len(b)
    high = (b[:, 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = np.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], axis=-1).reshape(n, 8)
    scales = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32
    codes = _nibble_halves(b[:, 8:136].reshape(n, 8, 16)).reshape(n, 256)
    return codes, _float16(b, 0), scales.astype(np.int8), None, None


_UNPACK: dict[str, Callable[[np.ndarray], Arrays]] = {
    "Q6_K": _unpack_q6_k, "Q3_K": _unpack_q3_k, "Q5_K": _unpack_q5_k, "Q2_K": _unpack_q2_k,
    "IQ4_NL": _unpack_iq4_nl, "IQ4_XS": _unpack_iq4_xs}


def parse(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> KQuantWeight:
    """A file's blocks (any shape holding [out, bytes a row]) -> the weight, its own copy of
    them (the file's pages can then be dropped)."""
    out, inp = shape
    f = FORMATS[kind]
    if inp % f.block_weights:
        raise ValueError(f"{kind}: {inp} inputs are not whole blocks of {f.block_weights}")
    blocks = np.array(raw, dtype=np.uint8, copy=True).reshape(
        out, inp // f.block_weights * f.block_bytes)
    return KQuantWeight(kind, torch.from_numpy(blocks), inp)


def parsers(kinds: type) -> dict[object, Callable[[np.ndarray, tuple[int, int]], KQuantWeight]]:
    """gguf.GGMLQuantizationType -> parse, for every format here."""
    return {getattr(kinds, kind): _parser(kind) for kind in FORMATS}


def _parser(kind: str) -> Callable[[np.ndarray, tuple[int, int]], KQuantWeight]:
    def parse_kind(raw: np.ndarray, shape: tuple[int, int]) -> KQuantWeight:
        return parse(kind, raw, shape)

    return parse_kind


def tile_planes(codes: torch.Tensor, low_bits: int, high_bits: int,
                columns: int) -> list[torch.Tensor]:
    """[N, K] codes -> the kernel's planes (one of low_bits, then one of high_bits if any), per
    column group of `columns` and block of 32 inputs: each eighth e of a block (inputs
    4e .. 4e + 3 of the 8 columns, byte 4j + i: column j's input 4e + i, as Q8_0's tiles) is
    a 32-byte vector of codes; a plane of b bits packs 8 / b such vectors into each of its b
    vectors a block, eighth e in vector e // (8 / b), at bits b * (e % (8 / b)).
    [N/8, K/32, b, 32] uint8 each."""
    n, k = codes.shape
    groups, blocks = n // columns, k // 32
    eighths = codes.numpy().reshape(groups, columns, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    eighths = eighths.reshape(groups, blocks, 8, 32)  # [group, block, e, byte]
    planes = []
    for shift, bits in ((0, low_bits), (low_bits, high_bits)):
        if not bits:
            continue
        per = 8 // bits
        part = ((eighths >> shift) & ((1 << bits) - 1)).reshape(groups, blocks, bits, per, 32)
        packed = np.zeros((groups, blocks, bits, 32), dtype=np.uint8)
        for s in range(per):
            packed |= part[:, :, :, s] << (bits * s)
        planes.append(torch.from_numpy(packed))
    return planes

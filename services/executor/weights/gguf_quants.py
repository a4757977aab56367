"""GGUF quantized block formats -> the native forms llmbus's quantized kernels take.

Q4_1Weight (4-bit codes, a scale and a minimum per 32 weights) and Q8_0Weight (int8 codes, a
scale per 32) serve the formats of 32-weight blocks: Q4_1 and Q8_0 are those forms; Q4_0 and
Q4_K convert to Q4_1 exactly, Q5_0 to Q8_0 exactly. Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL and
IQ4_XS keep their own form (k_quants.KQuantWeight), and Q5_1 is requantized to Q8_0, in the
fast mode only (`native_parsers(exact=True)` leaves them to be dequantized exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmbus.services.executor.weights import k_quants
from llmbus.services.executor.weights.k_quants import KQuantWeight, k_scales_and_mins

RowMap = Callable[[torch.Tensor], torch.Tensor]  # one tensor's rows, moved or cut

QUANT_GROUP = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
Q4_1_GROUP = QUANT_GROUP  # one float16 scale and one float16 minimum, 4-bit codes
_Q4_1_BLOCK_BYTES = 4 + QUANT_GROUP // 2
_Q8_0_BLOCK_BYTES = 2 + QUANT_GROUP  # one float16 scale, int8 codes
_Q4_0_BLOCK_BYTES = 2 + QUANT_GROUP // 2  # one float16 scale, 4-bit codes
_Q5_0_BLOCK_BYTES = 2 + 4 + QUANT_GROUP // 2  # float16 scale, the codes' 5th bits, 4-bit codes


@dataclass(frozen=True)
class KFactors:
    """A Q4_K matrix's scales as the file holds them, per 256-weight super-block (d, and the
    minimums' -dmin) and per 32-weight sub-block (6-bit integers): a block's scale is
    d * scale and its minimum -dmin * min. The integer kernel multiplies them as it goes, so
    that it holds 0.09 bytes of scales a weight, not 0.25 (quant_parts.QuantPart)."""

    d: torch.Tensor  # [out, in / 256] float32 (float16 values)
    neg_dmin: torch.Tensor  # [out, in / 256] float32
    scales: torch.Tensor  # [out, in / 32] uint8, 0..63
    mins: torch.Tensor  # [out, in / 32] uint8

    def map_rows(self, fn: RowMap) -> KFactors:
        return KFactors(*(fn(t) for t in (self.d, self.neg_dmin, self.scales, self.mins)))


@dataclass(frozen=True)
class Q4_1Weight:
    """A Q4_1 matrix [out, in]: weight = scale * code + minimum, per group of 32 inputs."""

    codes: torch.Tensor  # [out, in] uint8, 0..15
    scales: torch.Tensor  # [out, in / 32] float32 (float16 values; Q4_K: exact products)
    minimums: torch.Tensor  # [out, in / 32] float32, as scales
    k_factors: KFactors | None = None  # Q4_K: the factors of scales and minimums

    def map_rows(self, fn: RowMap) -> Q4_1Weight:
        """The same weight with `fn` applied to the rows of each tensor (a permutation)."""
        return Q4_1Weight(fn(self.codes), fn(self.scales), fn(self.minimums),
                          None if self.k_factors is None else self.k_factors.map_rows(fn))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], as llama.cpp and gguf-py compute it."""
        scales = self.scales.repeat_interleave(Q4_1_GROUP, dim=1)
        minimums = self.minimums.repeat_interleave(Q4_1_GROUP, dim=1)
        return scales * self.codes.float() + minimums


def _float16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block [out, groups, bytes] -> float32 [out, groups]."""
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """16 code bytes per group -> 32 codes: low nibbles are inputs 0..15, high ones 16..31."""
    return np.concatenate([packed & 0xF, packed >> 4], axis=-1).reshape(shape)


def parse_q4_1(raw: np.ndarray, shape: tuple[int, int]) -> Q4_1Weight:
    """Q4_1 bytes [out, in / 32 * 20] -> codes and per-group scale/minimum.

    Each 20-byte block is float16 d, float16 m, then 16 bytes whose low nibbles are inputs
    0..15 of the group and high nibbles inputs 16..31.
    """
    out, inp = shape
    blocks = np.ascontiguousarray(raw).reshape(out, inp // Q4_1_GROUP, _Q4_1_BLOCK_BYTES)
    return Q4_1Weight(torch.from_numpy(_nibbles(blocks[..., 4:], shape)),
                      torch.from_numpy(_float16_field(blocks, 0)),
                      torch.from_numpy(_float16_field(blocks, 2)))


def parse_q4_0(raw: np.ndarray, shape: tuple[int, int]) -> Q4_1Weight:
    """Q4_0 bytes -> the same weights in Q4_1 form: d * (code - 8) = d * code + (-8 d), with
    -8 d exact in float32, so every kernel for Q4_1 serves Q4_0 unchanged, bit for bit.

    Each 18-byte block is float16 d, then 16 bytes of codes in Q4_1's nibble order.
    """
    out, inp = shape
    blocks = np.ascontiguousarray(raw).reshape(out, inp // QUANT_GROUP, _Q4_0_BLOCK_BYTES)
    scales = _float16_field(blocks, 0)
    return Q4_1Weight(torch.from_numpy(_nibbles(blocks[..., 2:], shape)),
                      torch.from_numpy(scales), torch.from_numpy(-8 * scales))


_K_BLOCK = 256  # weights per K-quant super-block
_Q4_K_BLOCK_BYTES = 2 + 2 + 12 + _K_BLOCK // 2  # d, dmin, 8 packed 6-bit (scale, min), codes


def parse_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Q4_1Weight:
    """Q4_K bytes -> the same weights in Q4_1 form, exactly: each 32-weight sub-block is
    d * scale * code - dmin * min, and both products are exact in float32 (an 11-bit float16
    mantissa times a 6-bit integer), so every Q4_1 kernel serves Q4_K unchanged.

    Each 144-byte super-block of 256 weights: float16 d, float16 dmin, 12 bytes of packed
    6-bit scales and minimums, then 4 runs of 32 bytes: run r's low nibbles are sub-block 2r,
    its high nibbles sub-block 2r + 1.
    """
    out, inp = shape
    blocks = np.ascontiguousarray(raw).reshape(out, inp // _K_BLOCK, _Q4_K_BLOCK_BYTES)
    d, dmin = _float16_field(blocks, 0)[..., None], _float16_field(blocks, 2)[..., None]
    scales, mins = k_scales_and_mins(blocks[..., 4:16])  # [out, blocks, 8]
    runs = blocks[..., 16:].reshape(out, inp // _K_BLOCK, 4, 32)
    codes = np.stack([runs & 0xF, runs >> 4], axis=3).reshape(out, inp)  # sub-block order
    sub_blocks = inp // QUANT_GROUP
    factors = KFactors(torch.from_numpy(d[..., 0]), torch.from_numpy(-dmin[..., 0]),
                       torch.from_numpy(scales.astype(np.uint8).reshape(out, sub_blocks)),
                       torch.from_numpy(mins.astype(np.uint8).reshape(out, sub_blocks)))
    return Q4_1Weight(torch.from_numpy(codes),
                      torch.from_numpy((d * scales).reshape(out, sub_blocks)),
                      torch.from_numpy((-(dmin * mins)).reshape(out, sub_blocks)), factors)


def requantize_q8_0(values: np.ndarray) -> Q8_0Weight:
    """float32 [out, in] -> Q8_0 form with float32 scales (amax / 127 per 32 weights): for
    Q5_1, whose minimums no 8-bit kernel here takes exactly, and the K-quants in ONNX Runtime's
    graphs. Each
    weight moves by at most half a step of 1/254 of its block's range."""
    out, inp = values.shape
    groups = values.reshape(out, inp // QUANT_GROUP, QUANT_GROUP)
    scales = np.abs(groups).max(axis=-1) / 127.0  # [out, in / 32]
    safe = np.where(scales > 0, scales, 1.0)[..., None]
    codes = np.clip(np.rint(groups / safe), -127, 127).astype(np.int8).reshape(out, inp)
    return Q8_0Weight(torch.from_numpy(codes), torch.from_numpy(scales.astype(np.float32)))


@dataclass(frozen=True)
class Q8_0Weight:
    """A Q8_0 matrix [out, in]: weight = scale * code, per group of 32 inputs."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in / 32] float32 (float16 values; requantized: amax / 127)

    def map_rows(self, fn: RowMap) -> Q8_0Weight:
        return Q8_0Weight(fn(self.codes), fn(self.scales))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], as llama.cpp and gguf-py compute it."""
        return self.scales.repeat_interleave(QUANT_GROUP, dim=1) * self.codes.float()


def parse_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> Q8_0Weight:
    """Q8_0 bytes [out, in / 32 * 34] -> codes and per-group scales (float16 d, 32 int8)."""
    out, inp = shape
    blocks = np.ascontiguousarray(raw).reshape(out, inp // QUANT_GROUP, _Q8_0_BLOCK_BYTES)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(out, inp)
    return Q8_0Weight(torch.from_numpy(codes), torch.from_numpy(_float16_field(blocks, 0)))


def parse_q5_0(raw: np.ndarray, shape: tuple[int, int]) -> Q8_0Weight:
    """Q5_0 bytes -> the same weights in Q8_0 form, exactly: d * (code - 16) with the code in
    0..31, so code - 16 is an int8 and d the block's scale.

    Each 22-byte block is float16 d, a little-endian uint32 whose bit j is the 5th bit of
    input j, then 16 bytes in Q4_1's nibble order (low nibbles inputs 0..15).
    """
    out, inp = shape
    blocks = np.ascontiguousarray(raw).reshape(out, inp // QUANT_GROUP, _Q5_0_BLOCK_BYTES)
    high_bits = blocks[..., 2:6].copy().view("<u4")  # [out, groups, 1]
    fifth = (high_bits >> np.arange(QUANT_GROUP, dtype=np.uint32)) & 1  # [out, groups, 32]
    codes = _nibbles(blocks[..., 6:], (out, inp // QUANT_GROUP, QUANT_GROUP)) \
        | (fifth.astype(np.uint8) << 4)
    signed = (codes.astype(np.int16) - 16).astype(np.int8).reshape(out, inp)
    return Q8_0Weight(torch.from_numpy(signed), torch.from_numpy(_float16_field(blocks, 0)))


NativeWeight = Q4_1Weight | Q8_0Weight | KQuantWeight


REQUANTIZE_ROWS = 1024


def native_parsers(gguf: Any, exact: bool = False) -> dict[Any, Any]:
    """GGML type -> the parse of its bytes into a native form the quantized kernels take.

    `exact`: only the types whose native form holds the file's values exactly; the others
    (requantized in the fast mode) are then left to be dequantized, as gguf-py does."""
    def requantized(kind: Any) -> Callable[[np.ndarray, tuple[int, int]], Q8_0Weight]:
        def parse(raw: np.ndarray, shape: tuple[int, int]) -> Q8_0Weight:
            rows = np.ascontiguousarray(raw).reshape(shape[0], -1)
            weight = Q8_0Weight(torch.empty(shape, dtype=torch.int8),
                                torch.empty(shape[0], shape[1] // QUANT_GROUP))
            for first in range(0, shape[0], REQUANTIZE_ROWS):  # a few MiB of float32 at a time
                part = requantize_q8_0(np.asarray(gguf.quants.dequantize(
                    rows[first:first + REQUANTIZE_ROWS], kind), dtype=np.float32).reshape(
                    -1, shape[1]))
                weight.codes[first:first + REQUANTIZE_ROWS] = part.codes
                weight.scales[first:first + REQUANTIZE_ROWS] = part.scales
            return weight
        return parse

    kinds = gguf.GGMLQuantizationType
    exactly = {kinds.Q4_0: parse_q4_0, kinds.Q4_1: parse_q4_1, kinds.Q8_0: parse_q8_0,
               kinds.Q4_K: parse_q4_k, kinds.Q5_0: parse_q5_0}
    if exact:
        return exactly
    return exactly | k_quants.parsers(kinds) | {kinds.Q5_1: requantized(kinds.Q5_1)}

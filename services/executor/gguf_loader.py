"""Load a llama-family GGUF (architectures `llama` and `qwen2`) into a config and float weights.

Weights keep their GGUF names (`blk.{i}.attn_q.weight`, ...) in HF layout: `[out, in]`, with a
llama file's Q and K un-permuted from llama.cpp's interleaved rotary layout to the rotate_half
convention (qwen2 files keep HF's), so one RoPE implementation matches HF transformers on the
same file. Metadata is read under the file's architecture (`qwen2.block_count`, ...); qwen2's
Q/K/V biases load as `blk.{i}.attn_{q,k,v}.bias`.

`load_gguf(..., keep_native=True)` also returns the quantized matrices in a native form (codes
plus a scale, and for the 4-bit form a minimum, per 32 weights), for the quantized CPU matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    """The GGUF describes a model this executor cannot run."""


@dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    # RoPE scaling: every frequency divided by rope_linear_factor (`rope.scaling.type`
    # linear) and by its own factor (the `rope_freqs` tensor of Llama 3.1+ files).
    rope_linear_factor: float = 1.0
    rope_freq_factors: tuple[float, ...] | None = None
    # llama.cpp stores a llama file's Q/K rows with each head's rotary pairs interleaved (the
    # loader restores HF's halves); a qwen2 file keeps HF's layout.
    rotary_pairs_interleaved: bool = True


QUANT_GROUP = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
Q4_1_GROUP = QUANT_GROUP  # one float16 scale and one float16 minimum, 4-bit codes
_Q4_1_BLOCK_BYTES = 4 + QUANT_GROUP // 2
_Q8_0_BLOCK_BYTES = 2 + QUANT_GROUP  # one float16 scale, int8 codes
_Q4_0_BLOCK_BYTES = 2 + QUANT_GROUP // 2  # one float16 scale, 4-bit codes


@dataclass(frozen=True)
class Q4_1Weight:
    """A Q4_1 matrix [out, in]: weight = scale * code + minimum, per group of 32 inputs."""

    codes: torch.Tensor  # [out, in] uint8, 0..15
    scales: torch.Tensor  # [out, in / 32] float32 (exact float16 values)
    minimums: torch.Tensor  # [out, in / 32] float32 (exact float16 values)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], as llama.cpp and gguf-py compute it."""
        scales = self.scales.repeat_interleave(Q4_1_GROUP, dim=1)
        minimums = self.minimums.repeat_interleave(Q4_1_GROUP, dim=1)
        return scales * self.codes.float() + minimums


def _float16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block [out, groups, bytes] -> float32 [out, groups]."""
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
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


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit sub-block scales and minimums [..., 12] -> two [..., 8] arrays:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); 4-7 in the
    nibbles of bytes 8-11, their top 2 bits in the top bits of bytes 0-7."""
    p = packed.astype(np.uint16)
    scales = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)],
                            axis=-1)
    mins = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)],
                          axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


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
    scales, mins = _q4_k_scales_and_mins(blocks[..., 4:16])  # [out, blocks, 8]
    runs = blocks[..., 16:].reshape(out, inp // _K_BLOCK, 4, 32)
    codes = np.stack([runs & 0xF, runs >> 4], axis=3).reshape(out, inp)  # sub-block order
    return Q4_1Weight(torch.from_numpy(codes),
                      torch.from_numpy((d * scales).reshape(out, inp // QUANT_GROUP)),
                      torch.from_numpy((-(dmin * mins)).reshape(out, inp // QUANT_GROUP)))


def requantize_q8_0(values: np.ndarray) -> Q8_0Weight:
    """float32 [out, in] -> Q8_0 form with float32 scales (amax / 127 per 32 weights): for
    Q5_K and Q6_K, whose 16- and 32-weight sub-blocks no 8-bit kernel here takes exactly. Each
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
    scales: torch.Tensor  # [out, in / 32] float32 (exact float16 values)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], as llama.cpp and gguf-py compute it."""
        return self.scales.repeat_interleave(QUANT_GROUP, dim=1) * self.codes.float()


def parse_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> Q8_0Weight:
    """Q8_0 bytes [out, in / 32 * 34] -> codes and per-group scales (float16 d, 32 int8)."""
    out, inp = shape
    blocks = np.ascontiguousarray(raw).reshape(out, inp // QUANT_GROUP, _Q8_0_BLOCK_BYTES)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(out, inp)
    return Q8_0Weight(torch.from_numpy(codes), torch.from_numpy(_float16_field(blocks, 0)))


NativeWeight = Q4_1Weight | Q8_0Weight


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp rotary layout (pairs interleaved per head) -> HF layout (halves per head)."""
    out, inp = w.shape  # w: [out, in]
    return w.reshape(num_heads, out // num_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _required(reader: Any, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise UnsupportedModelError(f"GGUF lacks required metadata key {key!r}")
    return value


def read_config(reader: Any, tensor_shapes: dict[str, tuple[int, ...]]) -> LlamaConfig:
    """Hyper-parameters from GGUF metadata; `tensor_shapes` are numpy shapes (`[out, in]`)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")

    def field(key: str, default: Any = None) -> Any:  # the architecture's own keys
        return _field(reader, f"{arch}.{key}", default)

    def required(key: str) -> Any:
        return _required(reader, f"{arch}.{key}")
    if isinstance(field("feed_forward_length"), list):
        raise UnsupportedModelError("per-layer feed_forward_length is not supported")
    scaling = field("rope.scaling.type", "none")
    if scaling not in ("none", "", "linear"):
        raise UnsupportedModelError(f"{arch}.rope.scaling.type {scaling!r} is not supported "
                                    "(supported: none, linear, and the rope_freqs tensor)")
    if "token_embd.weight" not in tensor_shapes:
        raise UnsupportedModelError("GGUF lacks token_embd.weight")

    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // num_heads))
    rope_dim = int(field("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary ({rope_dim} of {head_dim}) is not supported")
    if tensor_shapes.get("rope_freqs.weight", (head_dim // 2,)) != (head_dim // 2,):
        raise UnsupportedModelError(f"rope_freqs.weight has shape "
                                    f"{tensor_shapes['rope_freqs.weight']}, expected "
                                    f"({head_dim // 2},): one factor per rotary frequency")
    linear = float(field("rope.scaling.factor", 1.0)) if scaling == "linear" \
        else 1.0

    eos_ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return LlamaConfig(
        num_layers=int(required("block_count")),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(field("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        # The embedding matrix is the truth; token lists are sometimes padded or short.
        vocab_size=int(tensor_shapes["token_embd.weight"][0]),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(field("context_length", 2048)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        rope_linear_factor=linear,
        rotary_pairs_interleaved=arch == "llama",
    )


def _native_parsers(gguf: Any) -> dict[Any, Any]:
    """GGML type -> the parse of its bytes into a native form the quantized kernels take."""
    def requantized(kind: Any):
        def parse(raw: np.ndarray, shape: tuple[int, int]) -> Q8_0Weight:
            return requantize_q8_0(np.asarray(gguf.quants.dequantize(raw, kind),
                                              dtype=np.float32).reshape(shape))
        return parse

    kinds = gguf.GGMLQuantizationType
    return {kinds.Q4_0: parse_q4_0, kinds.Q4_1: parse_q4_1, kinds.Q8_0: parse_q8_0,
            kinds.Q4_K: parse_q4_k, kinds.Q5_K: requantized(kinds.Q5_K),
            kinds.Q6_K: requantized(kinds.Q6_K)}


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, *, keep_native: bool = False,
    dense_for_native: bool = True,
) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, NativeWeight]]:
    """Read the config and dequantize every tensor to `dtype` (HF layout, see module doc).

    With `keep_native`, the third item holds each quantized matrix's native form as well (same
    names, same un-permuted layout): Q4_1 and Q8_0 as they are, Q4_0 and Q4_K in Q4_1 form
    (exactly), Q5_K and Q6_K requantized to Q8_0; otherwise it is empty.
    Without `dense_for_native`, a matrix with a native form has no dense copy in the second.
    """
    import gguf  # heavy import, only where a model is loaded

    parsers = _native_parsers(gguf)
    reader = gguf.GGUFReader(str(path))
    # Reader shapes are ggml order (innermost first); numpy order is reversed.
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = read_config(reader, shapes)
    weights: dict[str, torch.Tensor] = {}
    native: dict[str, NativeWeight] = {}
    for tensor in reader.tensors:
        heads = (config.num_heads if tensor.name.endswith("attn_q.weight") else
                 config.num_kv_heads if tensor.name.endswith("attn_k.weight") else None)
        if not config.rotary_pairs_interleaved:
            heads = None
        parse = parsers.get(tensor.tensor_type)
        native_form = keep_native and parse is not None and len(shapes[tensor.name]) == 2
        if dense_for_native or not native_form:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            array = np.asarray(array, dtype=np.float32).reshape(shapes[tensor.name])
            if heads:
                array = unpermute_qk(array, heads)
            if not array.flags.writeable:  # F32 tensors are read-only views of the memory map
                array = array.copy()
            weights[tensor.name] = torch.from_numpy(array).to(dtype)
        if native_form:
            q = parse(tensor.data, shapes[tensor.name])
            if heads:  # the permutation moves whole rows: codes, scales and minimums alike
                q = type(q)(*(torch.from_numpy(unpermute_qk(t.numpy(), heads))
                              for t in vars(q).values()))
            native[tensor.name] = q
    if "rope_freqs.weight" in weights:  # a property of the rotary embedding, not a weight
        factors = tuple(float(f) for f in weights.pop("rope_freqs.weight").float().tolist())
        config = replace(config, rope_freq_factors=factors)
    if config.tie_word_embeddings:
        if "token_embd.weight" in weights:
            weights["output.weight"] = weights["token_embd.weight"]
        if "token_embd.weight" in native:
            native["output.weight"] = native["token_embd.weight"]
    return config, weights, native

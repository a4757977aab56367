"""Load a llama-family GGUF (architectures `llama`, `qwen2`, `qwen3`) into a config and float
weights.

Weights keep their GGUF names (`blk.{i}.attn_q.weight`, ...) in HF layout: `[out, in]`, with a
llama file's Q and K un-permuted from llama.cpp's interleaved rotary layout to the rotate_half
convention (qwen2 and qwen3 files keep HF's), so one RoPE implementation matches HF transformers
on the same file. Metadata is read under the file's architecture (`qwen2.block_count`, ...);
qwen2's Q/K/V biases load as `blk.{i}.attn_{q,k,v}.bias`, qwen3's per-head Q/K norms as
`blk.{i}.attn_{q,k}_norm.weight` (and its head size, wider than hidden / heads, comes from
`qwen3.attention.key_length`).

`load_gguf(..., keep_native=True)` also returns the quantized matrices in a native form (codes
plus a scale, and for the 4-bit form a minimum, per 32 weights), for the quantized CPU matmuls.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmbus.services.executor.weights.gguf_quants import NativeWeight, native_parsers
from llmbus.services.executor.weights.matrices import MOE_ARCHITECTURES

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe")
# Gemma 3 as llama.cpp runs it: every 6th layer attends globally, the others in a sliding
# window with RoPE base 10,000 (the global layers' comes from the file); attention scaled by
# 1/√head_dim, by 1/√(hidden / heads) in the 27B (62 layers). (transformers' GGUF loader takes
# the same defaults.)
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0


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
    # loader restores HF's halves); a qwen2 or qwen3 file keeps HF's layout.
    rotary_pairs_interleaved: bool = True
    qk_norm: bool = False  # qwen3, gemma3: an RMSNorm on each Q and K head before RoPE
    # Gemma 3: embeddings times √hidden, norms after attention and after the MLP too, GeGLU
    # (tanh-approximated GELU), its own attention scale, and sliding-window layers.
    embedding_scale: float = 1.0
    post_norms: bool = False
    gelu: bool = False
    attention_scale: float | None = None  # None: 1/√head_dim
    sliding_window: int = 0  # keys a local layer's query sees, itself included; 0: none
    sliding_window_pattern: int = 0  # every n-th layer is global, the others local
    local_rope_theta: float | None = None  # the local layers' RoPE base, where it differs
    # A mixture of experts (Qwen3-MoE): each layer's MLP is `num_experts` experts of
    # `expert_intermediate_size`, of which a router picks `num_experts_used` per token, their
    # weights the softmax's top-k renormalised to sum to 1.
    num_experts: int = 0
    num_experts_used: int = 0
    expert_intermediate_size: int = 0

    @property
    def scale(self) -> float:
        return self.attention_scale or self.head_dim ** -0.5

    def window(self, layer: int) -> int:
        """Keys layer `layer` attends to back from each query (itself included); 0: all."""
        if not self.sliding_window or (self.sliding_window_pattern
                                       and (layer + 1) % self.sliding_window_pattern == 0):
            return 0
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` takes the local layers' RoPE (their base, no scaling)."""
        return bool(self.window(layer)) and self.local_rope_theta is not None


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
    moe = arch in MOE_ARCHITECTURES
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
    config = LlamaConfig(
        num_layers=int(required("block_count")),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length", 0) if moe
                              else required("feed_forward_length")),
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
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
    )
    if moe:
        config = replace(config, num_experts=int(required("expert_count")),
                         num_experts_used=int(required("expert_used_count")),
                         expert_intermediate_size=int(required("expert_feed_forward_length")))
    return _gemma3(config, field) if arch == "gemma3" else config


def _gemma3(config: LlamaConfig, field: Callable[..., Any]) -> LlamaConfig:
    num_layers = config.num_layers
    return replace(
        config, embedding_scale=float(np.float32(config.hidden_size ** 0.5)),  # as HF rounds it
        post_norms=True, gelu=True,
        attention_scale=(config.hidden_size / config.num_heads) ** -0.5 if num_layers == 62
        else None,
        sliding_window=int(field("attention.sliding_window", 0)),
        sliding_window_pattern=int(field("attention.sliding_window_pattern",
                                         GEMMA3_SLIDING_WINDOW_PATTERN)),
        local_rope_theta=GEMMA3_LOCAL_ROPE_THETA)


def _check_family_tensors(config: LlamaConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The tensors the architecture needs beyond llama's are there (named when not)."""
    if config.num_experts:
        e, d, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
        for i in range(config.num_layers):
            for name, shape in ((f"blk.{i}.ffn_gate_inp.weight", (e, d)),
                                (f"blk.{i}.ffn_gate_exps.weight", (e, f, d)),
                                (f"blk.{i}.ffn_up_exps.weight", (e, f, d)),
                                (f"blk.{i}.ffn_down_exps.weight", (e, d, f))):
                if shapes.get(name) != shape:
                    raise UnsupportedModelError(
                        f"GGUF lacks {name!r}" if name not in shapes else
                        f"{name!r} has shape {shapes[name]}, expected {shape}")
    if config.post_norms:
        for name in (f"blk.{i}.{n}.weight" for i in range(config.num_layers)
                     for n in ("post_attention_norm", "post_ffw_norm")):
            if name not in shapes:
                raise UnsupportedModelError(f"GGUF lacks {name!r}")
    if config.qk_norm:
        for name in (f"blk.{i}.attn_{n}_norm.weight" for i in range(config.num_layers)
                     for n in "qk"):
            if shapes.get(name) != (config.head_dim,):
                raise UnsupportedModelError(
                    f"GGUF lacks {name!r}" if name not in shapes else
                    f"{name!r} has shape {shapes[name]}, expected ({config.head_dim},)")


def _drop_pages(reader: Any, tensor: Any) -> None:
    """Let the kernel drop the file pages of a tensor already copied out: the mapping would
    otherwise keep the whole file resident beside the weights made from it."""
    page = mmap.PAGESIZE
    start = tensor.data_offset // page * page
    end = -(-(tensor.data_offset + tensor.n_bytes) // page) * page
    try:
        reader.data._mmap.madvise(mmap.MADV_DONTNEED, start, min(end, len(reader.data)) - start)
    except (AttributeError, OSError, ValueError):  # no madvise here: the pages just stay
        pass


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, *, keep_native: bool = False,
    dense_for_native: bool = True, transform: Callable[[str, NativeWeight], Any] | None = None,
    exact: bool = False,
) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, NativeWeight]]:
    """Read the config and dequantize every tensor to `dtype` (HF layout, see module doc).

    With `keep_native`, the third item holds each quantized matrix's native form as well (same
    names, same un-permuted layout): Q4_1 and Q8_0 as they are, Q4_0 and Q4_K in Q4_1 form
    and Q5_0 in Q8_0 form (exactly), Q5_1, Q5_K and Q6_K requantized to Q8_0 unless `exact`
    (then they load dense, with the file's values); otherwise it is empty.
    Without `dense_for_native`, a matrix with a native form has no dense copy in the second.
    `transform(name, native)` replaces each native form as soon as it is parsed.
    """
    import gguf  # heavy import, only where a model is loaded

    parsers = native_parsers(gguf, exact=exact)
    reader = gguf.GGUFReader(str(path))
    # Reader shapes are ggml order (innermost first); numpy order is reversed.
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = read_config(reader, shapes)
    _check_family_tensors(config, shapes)
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
                q = q.map_rows(lambda t, h=heads: torch.from_numpy(unpermute_qk(t.numpy(), h)))
            native[tensor.name] = q if transform is None else transform(tensor.name, q)
        _drop_pages(reader, tensor)
    if "rope_freqs.weight" in weights:  # a property of the rotary embedding, not a weight
        factors = tuple(float(f) for f in weights.pop("rope_freqs.weight").float().tolist())
        config = replace(config, rope_freq_factors=factors)
    if config.tie_word_embeddings:
        if "token_embd.weight" in weights:
            weights["output.weight"] = weights["token_embd.weight"]
        if "token_embd.weight" in native:
            native["output.weight"] = native["token_embd.weight"]
    return config, weights, native


def qk_norm_weights(weights: dict[str, torch.Tensor],
                    layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer `layer`'s per-head Q and K norm weights ([Dh] each; qwen3 files), or None."""
    names = (f"blk.{layer}.attn_q_norm.weight", f"blk.{layer}.attn_k_norm.weight")
    if names[0] not in weights:
        return None
    return weights[names[0]], weights[names[1]]


def qkv_bias(weights: dict[str, torch.Tensor], layer: int) -> torch.Tensor | None:
    """Layer `layer`'s Q, K and V biases stacked like its fused projection (qwen2 files have
    them), or None."""
    names = [f"blk.{layer}.attn_{n}.bias" for n in "qkv"]
    present = [n in weights for n in names]
    if not any(present):
        return None
    if not all(present):
        raise UnsupportedModelError(f"layer {layer} has only some of the Q/K/V biases")
    return torch.cat([weights[n].float() for n in names])

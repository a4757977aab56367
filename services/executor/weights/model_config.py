"""A GGUF's hyper-parameters as one config (`LlamaConfig`), read from its metadata under the
file's architecture (`qwen2.block_count`, ...), and the tensors each architecture needs beyond
llama's. The families differ in a few switches (Q/K/V biases, Q/K norms, Gemma 3's post-norms,
GeGLU, windows; experts), which every backend reads from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from llmbus.services.executor.weights.matrices import MOE_ARCHITECTURES

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe")
# Gemma 3 as llama.cpp runs it: every 6th layer attends globally, the others in a sliding
# window with RoPE base 10,000 (the global layers' comes from the file); attention scaled by
# 1/√head_dim, by 1/√(hidden / heads) in the 27B (62 layers). (transformers' GGUF loader takes
# the same pattern and local base, but scales every size by 1/√256.)
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
    # A pipeline shard's part of the model (weights/layer_slice.py): its layers are the
    # model's layer_offset.. layer_offset + num_layers; a layer shard holds no vocabulary
    # matrices (token embedding, output head) and no final norm.
    layer_offset: int = 0
    has_vocab: bool = True

    @property
    def scale(self) -> float:
        return self.attention_scale or self.head_dim ** -0.5

    def window(self, layer: int) -> int:
        """Keys layer `layer` (of this shard's, see layer_offset) attends to back from each
        query (itself included); 0: all."""
        layer += self.layer_offset
        if not self.sliding_window or (self.sliding_window_pattern
                                       and (layer + 1) % self.sliding_window_pattern == 0):
            return 0
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` takes the local layers' RoPE (their base, no scaling)."""
        return bool(self.window(layer)) and self.local_rope_theta is not None


def _field(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key)
    return default if value is None else value


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    value = _field(metadata, key)
    if value is None:
        raise UnsupportedModelError(f"GGUF lacks required metadata key {key!r}")
    return value


def read_config(metadata: Mapping[str, Any],
                tensor_shapes: dict[str, tuple[int, ...]]) -> LlamaConfig:
    """Hyper-parameters from GGUF metadata (key -> value, services/gguf_metadata.py's reading);
    `tensor_shapes` are numpy shapes (`[out, in]`)."""
    arch = _field(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")

    def field(key: str, default: Any = None) -> Any:  # the architecture's own keys
        return _field(metadata, f"{arch}.{key}", default)

    def required(key: str) -> Any:
        return _required(metadata, f"{arch}.{key}")
    moe = arch in MOE_ARCHITECTURES
    if isinstance(field("feed_forward_length"), list):
        raise UnsupportedModelError("per-layer feed_forward_length is not supported")
    if "token_embd.weight" not in tensor_shapes:
        raise UnsupportedModelError("GGUF lacks token_embd.weight")

    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // num_heads))
    linear = _rope_linear_factor(arch, field, tensor_shapes, head_dim)

    eos_ids = [_field(metadata, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    bos = _field(metadata, "tokenizer.ggml.bos_token_id")
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
    return _gemma3(config, field, required) if arch == "gemma3" else config


def _rope_linear_factor(arch: str, field: Callable[..., Any],
                        tensor_shapes: dict[str, tuple[int, ...]], head_dim: int) -> float:
    """The linear RoPE scaling factor (1.0: none), after refusing the RoPE variants the
    backends do not compute: other scalings, a partial rotary, a rope_freqs of another width."""
    scaling = field("rope.scaling.type", "none")
    if scaling not in ("none", "", "linear"):
        raise UnsupportedModelError(f"{arch}.rope.scaling.type {scaling!r} is not supported "
                                    "(supported: none, linear, and the rope_freqs tensor)")
    rope_dim = int(field("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary ({rope_dim} of {head_dim}) is not supported")
    if tensor_shapes.get("rope_freqs.weight", (head_dim // 2,)) != (head_dim // 2,):
        raise UnsupportedModelError(f"rope_freqs.weight has shape "
                                    f"{tensor_shapes['rope_freqs.weight']}, expected "
                                    f"({head_dim // 2},): one factor per rotary frequency")
    return float(field("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0


def _gemma3(config: LlamaConfig, field: Callable[..., Any],
            required: Callable[[str], Any]) -> LlamaConfig:
    num_layers = config.num_layers
    return replace(
        config, embedding_scale=float(np.float32(config.hidden_size ** 0.5)),  # as HF rounds it
        post_norms=True, gelu=True,
        attention_scale=(config.hidden_size / config.num_heads) ** -0.5 if num_layers == 62
        else None,
        sliding_window=int(required("attention.sliding_window")),  # none: another model
        sliding_window_pattern=int(field("attention.sliding_window_pattern",
                                         GEMMA3_SLIDING_WINDOW_PATTERN)),
        local_rope_theta=GEMMA3_LOCAL_ROPE_THETA)


def check_family_tensors(config: LlamaConfig, shapes: dict[str, tuple[int, ...]]) -> None:
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

"""A BERT-family encoder's hyper-parameters (`EncoderConfig`), read from the GGUF metadata
llama.cpp's converter writes for `bert` (bge, all-MiniLM, mxbai-embed) and `nomic-bert`
(nomic-embed-text), and the tensors each needs.

The two differ in positions (a learned table vs rotary with `<arch>.rope.freq_base`), the
attention projection (separate Q/K/V with biases, or one fused `attn_qkv`) and the MLP (GELU
vs SwiGLU with `ffn_gate`); both normalise after each residual add (post-norm) with
LayerNorm. Decoders are model_config.py's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmbus.services.executor.weights.model_config import UnsupportedModelError

ENCODER_ARCHITECTURES = ("bert", "nomic-bert")
# llama.cpp's `<arch>.pooling_type` enum (LLAMA_POOLING_TYPE_*), by value
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")
DEFAULT_ROPE_FREQ_BASE = 10_000.0  # llama.cpp's, when a nomic-bert file has no key


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str  # "bert" or "nomic-bert"
    vocab_size: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_norm_eps: float
    context_length: int  # the position table's rows (bert), the trained length (nomic-bert)
    pooling_type: int | None  # llama.cpp's enum (POOLING_TYPES); None: the file has none
    rope_theta: float | None  # nomic-bert's rotary base; None for learned positions
    has_token_types: bool  # a `token_types` table (row 0 is added to every token)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary(self) -> bool:
        return self.rope_theta is not None


def _required(metadata: Mapping[str, Any], arch: str, key: str) -> Any:
    value = metadata.get(f"{arch}.{key}")
    if value is None:
        raise UnsupportedModelError(f"{arch} encoder: the GGUF has no {arch}.{key}")
    return value


def read_encoder_config(metadata: Mapping[str, Any],
                        shapes: Mapping[str, tuple[int, ...]]) -> EncoderConfig:
    """The config of a `bert` or `nomic-bert` file; UnsupportedModelError (one line naming
    what is missing or wrong) for anything else, or a file lacking a needed key or tensor."""
    arch = metadata.get("general.architecture")
    if arch not in ENCODER_ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not an encoder this executor "
                                    f"runs; supported: {', '.join(ENCODER_ARCHITECTURES)}")
    pooling_type = metadata.get(f"{arch}.pooling_type")
    if pooling_type is not None and not 0 <= int(pooling_type) < len(POOLING_TYPES):
        raise UnsupportedModelError(f"{arch}.pooling_type {pooling_type} is not one of "
                                    f"llama.cpp's (0..{len(POOLING_TYPES) - 1})")
    if metadata.get(f"{arch}.attention.causal", False):
        raise UnsupportedModelError(f"{arch}.attention.causal is true: not a bidirectional "
                                    "encoder")
    if "token_embd.weight" not in shapes:
        raise UnsupportedModelError(f"{arch} encoder: the GGUF has no tensor token_embd.weight")
    config = EncoderConfig(
        architecture=arch, vocab_size=shapes["token_embd.weight"][0],
        num_layers=int(_required(metadata, arch, "block_count")),
        hidden_size=int(_required(metadata, arch, "embedding_length")),
        intermediate_size=int(_required(metadata, arch, "feed_forward_length")),
        num_heads=int(_required(metadata, arch, "attention.head_count")),
        layer_norm_eps=float(_required(metadata, arch, "attention.layer_norm_epsilon")),
        context_length=int(_required(metadata, arch, "context_length")),
        pooling_type=None if pooling_type is None else int(pooling_type),
        rope_theta=(float(metadata.get(f"{arch}.rope.freq_base", DEFAULT_ROPE_FREQ_BASE))
                    if arch == "nomic-bert" else None),
        has_token_types="token_types.weight" in shapes)
    if config.hidden_size % config.num_heads:
        raise UnsupportedModelError(f"{arch}: embedding_length {config.hidden_size} is not a "
                                    f"multiple of head_count {config.num_heads}")
    check_encoder_tensors(config, shapes)
    return config


def encoder_tensor_names(config: EncoderConfig, layer: int,
                         fused_qkv: bool) -> list[str]:
    """The weight tensors layer `layer` needs (biases are optional: bert has them, nomic-bert
    not)."""
    p = f"blk.{layer}."
    attention = ["attn_qkv"] if fused_qkv else ["attn_q", "attn_k", "attn_v"]
    mlp = ["ffn_up", "ffn_gate", "ffn_down"] if config.rotary else ["ffn_up", "ffn_down"]
    return [p + n + ".weight" for n in [*attention, "attn_output", "attn_output_norm", *mlp,
                                        "layer_output_norm"]]


def check_encoder_tensors(config: EncoderConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """UnsupportedModelError naming the first tensor the forward needs that the file lacks."""
    needed = ["token_embd_norm.weight"]
    if not config.rotary:
        needed.append("position_embd.weight")
    for layer in range(config.num_layers):
        needed += encoder_tensor_names(config, layer, f"blk.{layer}.attn_qkv.weight" in shapes)
    for name in needed:
        if name not in shapes:
            raise UnsupportedModelError(f"{config.architecture} encoder: the GGUF has no "
                                        f"tensor {name}")

"""The BERT-family encoder forward (llama.cpp's `bert` and `nomic-bert`) in float32 torch: the
final hidden states of a flat batch of sequences, for embeddings.

An encoder is not a decoder without a cache: every token attends to every token of its own
sequence, both ways (no causal mask), and nothing is kept between calls, so there is no KV
cache, no block table and no step protocol here; the executor calls `forward` on whole
prompts. Per layer (post-norm, as BERT was trained):

    x = LayerNorm(x + Wo·Attention(x))          bidirectional, within each sequence
    x = LayerNorm(x + MLP(x))                   bert: down(GELU_erf(up x)),
                                                nomic-bert: down(SiLU(gate x) ⊙ up x)

after the embeddings x = LayerNorm(token + token_type[0] + position) (bert: a learned table,
positions restart at 0 in each sequence; nomic-bert: none, Q and K are rotated instead, HF's
rotate_half layout as llama.cpp's NEOX rope). Weights are dequantized to dense float32 at
load: embedding models are small, and exactness against transformers comes first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmbus.services.executor.attention.rope import apply_rope
from llmbus.services.executor.weights.encoder_config import EncoderConfig, read_encoder_config
from llmbus.services.executor.weights.gguf_file import MappedGGUF


def dense_weights(reader: MappedGGUF) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantized to float32, GGUF names, HF layout ([out, in]:
    encoders' Q and K are written unpermuted, so nothing is reordered)."""
    import gguf  # heavy import, only where a model is loaded

    weights = {}
    for tensor in reader.tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32).reshape(tensor.shape)  # a copy: writable
        weights[tensor.name] = torch.from_numpy(array)
        reader.drop_pages(tensor)
    return weights


def rotary_tables(positions: torch.Tensor, head_dim: int,
                  theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, Dh] for each token's position, rotate_half layout (halves paired)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)  # [T, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, Dh]
    return emb.cos(), emb.sin()


class EncoderModel:
    """A `bert` or `nomic-bert` GGUF's weights and its forward; stateless between calls."""

    def __init__(self, config: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = weights  # GGUF names -> float32, [out, in]

    @classmethod
    def load(cls, path: str | Path) -> EncoderModel:
        """Read a `bert`/`nomic-bert` file; UnsupportedModelError (one line) for any other
        file, or one that lacks what the forward needs."""
        reader = MappedGGUF(path)
        config = read_encoder_config(reader.metadata, {t.name: t.shape for t in reader.tensors})
        return cls(config, dense_weights(reader))

    def _optional(self, name: str) -> torch.Tensor | None:
        return self.weights.get(name)

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weights[f"{name}.weight"],
                            self._optional(f"{name}.bias"), self.config.layer_norm_eps)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[f"{name}.weight"], self._optional(f"{name}.bias"))

    def forward(self, input_ids: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """input_ids [T] (int64), the sequences one after another, `seq_lens` long (each >= 1,
        summing to T) -> final hidden states [T, D] float32. Each sequence attends to itself
        only, so a row does not depend on what else is in the batch."""
        self._check(input_ids, seq_lens)
        lens = torch.tensor(list(seq_lens), dtype=torch.int64)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        positions = torch.arange(input_ids.shape[0]) - starts  # [T], from 0 in each sequence
        x = self._embed(input_ids, positions)  # [T, D]
        rope = (rotary_tables(positions, self.config.head_dim, self.config.rope_theta)
                if self.config.rope_theta is not None else None)
        for layer in range(self.config.num_layers):
            x = self._layer(layer, x, seq_lens, rope)
        return x

    def _check(self, input_ids: torch.Tensor, seq_lens: Sequence[int]) -> None:
        config = self.config
        if input_ids.dim() != 1 or sum(seq_lens) != input_ids.shape[0] or \
                min(seq_lens, default=1) < 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} does not hold sequences of "
                             f"lengths {list(seq_lens)} (each at least 1)")
        if not config.rotary and max(seq_lens, default=0) > config.context_length:
            raise ValueError(f"a sequence of {max(seq_lens)} tokens is longer than the "
                             f"model's {config.context_length} positions")
        if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < \
                config.vocab_size:
            raise ValueError(f"token ids must be in [0, {config.vocab_size})")

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LayerNorm(token + token_type[0] + position): every token is of segment A, as
        llama.cpp and an embedding request have it; summed in transformers' order."""
        x = self.weights["token_embd.weight"][input_ids]  # [T, D]
        if self.config.has_token_types:
            x = x + self.weights["token_types.weight"][0]
        if not self.config.rotary:
            x = x + self.weights["position_embd.weight"][positions]
        return self._layer_norm(x, "token_embd_norm")

    def _qkv(self, p: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Q, K, V [T, D] each, from one fused projection (nomic-bert) or three."""
        if f"{p}attn_qkv.weight" in self.weights:
            return tuple(self._linear(x, p + "attn_qkv").chunk(3, dim=-1))
        return tuple(self._linear(x, p + name) for name in ("attn_q", "attn_k", "attn_v"))

    def _attention(self, p: str, x: torch.Tensor, seq_lens: Sequence[int],
                   rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Bidirectional attention of each sequence over itself: x [T, D] -> [T, D]."""
        heads, head_dim = self.config.num_heads, self.config.head_dim
        q, k, v = (t.reshape(-1, heads, head_dim) for t in self._qkv(p, x))  # [T, H, Dh]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        outputs = []
        for q_s, k_s, v_s in zip(*(t.split(list(seq_lens)) for t in (q, k, v)), strict=True):
            # [H, L, Dh]; no mask: every token sees its whole sequence (and only it)
            out = F.scaled_dot_product_attention(
                q_s.transpose(0, 1), k_s.transpose(0, 1), v_s.transpose(0, 1))
            outputs.append(out.transpose(0, 1).reshape(-1, heads * head_dim))
        return self._linear(torch.cat(outputs), p + "attn_output")

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        if self.config.rotary:  # nomic-bert: SwiGLU
            return self._linear(F.silu(self._linear(x, p + "ffn_gate"))
                                * self._linear(x, p + "ffn_up"), p + "ffn_down")
        # transformers' "gelu" (BERT's): the erf form, not llama.cpp's tanh approximation
        return self._linear(F.gelu(self._linear(x, p + "ffn_up")), p + "ffn_down")

    def _layer(self, layer: int, x: torch.Tensor, seq_lens: Sequence[int],
               rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        p = f"blk.{layer}."
        x = self._layer_norm(self._attention(p, x, seq_lens, rope) + x, p + "attn_output_norm")
        return self._layer_norm(self._mlp(p, x) + x, p + "layer_output_norm")

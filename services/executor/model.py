"""Llama in plain torch over a flattened batch and a paged KV cache.

A step is one flat token stream: T tokens from B sequences, each a prefill chunk or a decode
token. Shapes below use T (tokens in the step), B (sequences), D (hidden), H / Hkv (query / KV
heads), Dh (head dim), S (sequences that sample), V (vocab).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from services.executor.gguf_loader import LlamaConfig, load_gguf
from services.executor.kv_cache import NULL_BLOCK_ID, KVCache


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys live in this step; shared by every layer."""

    cu_seqlens_q: torch.Tensor  # [B+1] int64, query start offsets into the flat stream
    context_lens: torch.Tensor  # [B] int64, tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each new token
    positions: torch.Tensor  # [T] int64
    block_size: int
    # Layout for the torch attention, computed once per step instead of once per layer.
    query_gather: torch.Tensor  # [B, max_q] flat index of each padded query (pads repeat)
    query_scatter: torch.Tensor  # [T] index of each token in the padded [B * max_q] queries
    kv_slots: torch.Tensor  # [B, max_ctx] cache slot of each context position (pads: block 0)
    attn_mask: torch.Tensor  # [B, 1, max_q, max_ctx] bool, True = may attend
    _folded_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def folded_mask(self, group: int) -> torch.Tensor:
        """The mask for queries folded as [B, Hkv, group * max_q] (see paged_attention)."""
        if group not in self._folded_masks:
            self._folded_masks[group] = self.attn_mask.repeat(1, 1, group, 1)
        return self._folded_masks[group]


def build_attention_metadata(
    query_lens: Sequence[int], context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Sequence b computes positions [context_lens[b] - query_lens[b], context_lens[b])."""
    num_seqs = len(query_lens)
    max_q, max_ctx = max(query_lens), max(context_lens)
    num_blocks = -(-max_ctx // block_size)
    padded = [list(bt[:num_blocks]) + [NULL_BLOCK_ID] * (num_blocks - min(len(bt), num_blocks))
              for bt in block_tables]
    table = torch.tensor(padded, dtype=torch.int32, device=device)  # [B, max_blocks]
    q_lens = torch.tensor(query_lens, dtype=torch.int64, device=device)  # [B]
    ctx = torch.tensor(context_lens, dtype=torch.int64, device=device)  # [B]
    cu = F.pad(torch.cumsum(q_lens, 0), (1, 0))  # [B+1]
    num_tokens = int(cu[-1])

    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)  # [T]
    index_in_seq = torch.arange(num_tokens, device=device) - cu[seq]  # [T]
    positions = ctx[seq] - q_lens[seq] + index_in_seq  # [T]
    slot_mapping = table[seq, positions // block_size].long() * block_size \
        + positions % block_size  # [T]

    qi = torch.arange(max_q, device=device)  # [max_q]
    query_gather = cu[:-1, None] + torch.minimum(qi[None], q_lens[:, None] - 1)  # [B, max_q]
    query_scatter = seq * max_q + index_in_seq  # [T]
    kj = torch.arange(max_ctx, device=device)  # [max_ctx]
    kv_slots = table[:, kj // block_size].long() * block_size + kj % block_size  # [B, max_ctx]
    q_pos = (ctx - q_lens)[:, None] + qi[None]  # [B, max_q]; pads run past ctx: no empty rows
    attn_mask = (kj[None, None] <= q_pos[:, :, None]) & (kj[None, None] < ctx[:, None, None])
    return AttentionMetadata(
        cu_seqlens_q=cu, context_lens=ctx, block_tables=table, slot_mapping=slot_mapping,
        positions=positions, block_size=block_size, query_gather=query_gather,
        query_scatter=query_scatter, kv_slots=kv_slots, attn_mask=attn_mask[:, None])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V ([T, Hkv, Dh]) into caches [num_blocks, block_size, Hkv, Dh]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of q [T, H, Dh] over each sequence's cached context -> [T, H * Dh].

    Torch reference path: gather the paged KV into padded per-sequence tensors and run one
    batched SDPA. For GQA the `group = H // Hkv` query heads sharing a KV head are folded into
    the query-length axis, so K/V are never repeated.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs, max_q = meta.query_gather.shape
    k = k_cache.view(-1, num_kv_heads, head_dim)[meta.kv_slots]  # [B, max_ctx, Hkv, Dh]
    v = v_cache.view(-1, num_kv_heads, head_dim)[meta.kv_slots]  # [B, max_ctx, Hkv, Dh]
    qp = q[meta.query_gather]  # [B, max_q, H, Dh]
    qp = qp.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)  # [B, Hkv, g*max_q, Dh]
    out = F.scaled_dot_product_attention(
        qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta.folded_mask(group),
        scale=scale)  # [B, Hkv, g*max_q, Dh]
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, num_heads * head_dim)  # [B*max_q, H*Dh]
    return out[meta.query_scatter]  # [T, H*Dh]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in float32 as HF does, so bf16 runs stay close to the float32 reference.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(config: LlamaConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, Dh] in the HF (rotate_half) layout, computed as HF does."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta
                      ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh]; cos/sin [T, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2 Hkv) * Dh, D], Q/K/V fused: one matmul instead of three
    attn_output: torch.Tensor  # [D, H * Dh]
    ffn_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 F, D], gate and up fused
    down: torch.Tensor  # [D, F]


class LlamaModel:
    """Weights plus the forward; the KV cache is passed in (the runner owns it)."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *,
                 max_positions: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            self.layers.append(_Layer(
                attn_norm=w(p + "attn_norm.weight"),
                qkv=torch.cat([w(p + f"attn_{n}.weight") for n in "qkv"]),
                attn_output=w(p + "attn_output.weight"),
                ffn_norm=w(p + "ffn_norm.weight"),
                gate_up=torch.cat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
                down=w(p + "ffn_down.weight")))
        self.embed = w("token_embd.weight")  # [V, D]
        self.lm_head = self.embed if config.tie_word_embeddings else w("output.weight")
        self.output_norm = w("output_norm.weight")
        cos, sin = rope_tables(config, max_positions)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)  # [P, Dh]
        self.scale = config.head_dim ** -0.5

    @classmethod
    def from_gguf(cls, path: str | Path, *, max_positions: int | None = None,
                  dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> LlamaModel:
        config, weights = load_gguf(path)
        return cls(config, weights, max_positions=max_positions or config.context_length,
                   dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logits_indices [S] -> float32 logits [S, V].

        Writes this step's K/V into `kv_cache` at `meta.slot_mapping`.
        """
        cfg = self.config
        num_tokens = input_ids.shape[0]
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, Dh]
        h = self.embed[input_ids]  # [T, D]
        for index, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv)  # [T, (H + 2 Hkv) * Dh]
            # RoPE on Q and K in one pass: [T, H + Hkv, Dh]
            qk = apply_rope(qkv[:, :q_width + kv_width].view(num_tokens, -1, cfg.head_dim),
                            cos, sin)
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]  # [T, H, Dh], [T, Hkv, Dh]
            v = qkv[:, q_width + kv_width:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv_cache.layer(index)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, H * Dh]
            h = h + F.linear(attn, layer.attn_output)
            x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)  # each [T, F]
            h = h + F.linear(F.silu(gate) * up, layer.down)
        # Only the positions that sample pay for the norm and the vocab projection.
        h = rms_norm(h[logits_indices], self.output_norm, cfg.rms_norm_eps)  # [S, D]
        return F.linear(h, self.lm_head).float()  # [S, V]

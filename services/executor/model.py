# Over 300 lines: the reference model's forward with the attention metadata and torch ops it
# defines for every backend; split, each part would be read only beside the others.
"""Llama in plain torch over a flattened batch and a paged KV cache.

A step is one flat token stream: T tokens from B sequences, each a prefill chunk or a decode
token. Shapes below use T (tokens in the step), B (sequences), D (hidden), H / Hkv (query / KV
heads), Dh (head dim), S (sequences that sample), V (vocab).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmbus.services.executor.gguf_loader import LlamaConfig, UnsupportedModelError
from llmbus.services.executor.gguf_quants import NativeWeight
from llmbus.services.executor.kv_cache import NULL_BLOCK_ID, KVCache
from llmbus.services.executor.linear import DenseLinear, Linear, make_linear


@dataclass
class AttentionLayout:
    """Padded torch layout of one group of sequences (decodes, or prefill chunks).

    Decodes and prefill chunks are attended to separately: padding a decode's single query to
    a 500-token prefill chunk would multiply its work by 500. K/V are gathered whole blocks at
    a time (`index_select` on the block axis copies rows, 5x faster than per-slot indexing).
    """

    token_index: torch.Tensor  # [Tg] flat indices of this group's tokens
    query_gather: torch.Tensor  # [Bg, max_q] flat index of each padded query (pads repeat)
    query_scatter: torch.Tensor  # [Tg] index of each token in the padded [Bg * max_q] queries
    kv_blocks: torch.Tensor  # [Bg * blocks] int64 block ids, row-major (pads: block 0)
    context_width: int  # blocks * block_size: the padded context length L
    attn_mask: torch.Tensor  # [Bg, 1, max_q, L] bool, True = may attend
    _folded_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def folded_mask(self, group: int) -> torch.Tensor:
        """The mask for queries folded as [Bg, Hkv, group * max_q] (see _attend)."""
        if self.attn_mask.shape[2] == 1:
            return self.attn_mask  # decodes: one query per sequence, the mask broadcasts
        if group not in self._folded_masks:
            self._folded_masks[group] = self.attn_mask.repeat(1, 1, group, 1)
        return self._folded_masks[group]


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys live in this step; shared by every layer."""

    cu_seqlens_q: torch.Tensor  # [B+1] int64, query start offsets into the flat stream
    context_lens: torch.Tensor  # [B] int64, tokens in the cache after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each new token
    positions: torch.Tensor  # [T] int64
    block_size: int
    max_query_len: int  # a host int, so kernel launches need no device sync
    # Layouts for the torch attention, computed once per step instead of once per layer.
    layouts: list[AttentionLayout]


def build_attention_metadata(
    query_lens: Sequence[int], context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Sequence b computes positions [context_lens[b] - query_lens[b], context_lens[b])."""
    num_seqs = len(query_lens)
    max_ctx = max(context_lens)
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

    decode_ids = [b for b, n in enumerate(query_lens) if n == 1]
    prefill_ids = [b for b, n in enumerate(query_lens) if n > 1]
    layouts = [_layout(ids, query_lens, context_lens, table, cu, block_size, device)
               for ids in (decode_ids, prefill_ids) if ids]
    return AttentionMetadata(
        cu_seqlens_q=cu, context_lens=ctx, block_tables=table, slot_mapping=slot_mapping,
        positions=positions, block_size=block_size, max_query_len=max(query_lens),
        layouts=layouts)


def _layout(seq_ids: list[int], query_lens: Sequence[int], context_lens: Sequence[int],
            table: torch.Tensor, cu: torch.Tensor, block_size: int,
            device: torch.device | str) -> AttentionLayout:
    """The padded layout of the sequences `seq_ids` (indices into the step's batch)."""
    ids = torch.tensor(seq_ids, dtype=torch.int64, device=device)  # [Bg]
    q_lens = torch.tensor([query_lens[b] for b in seq_ids], dtype=torch.int64,
                          device=device)  # [Bg]
    ctx = torch.tensor([context_lens[b] for b in seq_ids], dtype=torch.int64,
                       device=device)  # [Bg]
    max_q, max_ctx = int(q_lens.max()), int(ctx.max())
    num_blocks = -(-max_ctx // block_size)
    width = num_blocks * block_size  # L
    starts = cu[ids]  # [Bg] flat offset of each sequence's first query
    local = torch.repeat_interleave(torch.arange(len(seq_ids), device=device), q_lens)  # [Tg]
    local_cu = F.pad(torch.cumsum(q_lens, 0), (1, 0))  # [Bg+1]
    index_in_seq = torch.arange(int(local_cu[-1]), device=device) - local_cu[local]  # [Tg]
    qi = torch.arange(max_q, device=device)  # [max_q]
    kj = torch.arange(width, device=device)  # [L]
    q_pos = (ctx - q_lens)[:, None] + qi[None]  # [Bg, max_q]; pads run past ctx: no empty rows
    attn_mask = (kj[None, None] <= q_pos[:, :, None]) & (kj[None, None] < ctx[:, None, None])
    return AttentionLayout(
        token_index=starts[local] + index_in_seq,
        query_gather=starts[:, None] + torch.minimum(qi[None], q_lens[:, None] - 1),
        query_scatter=local * max_q + index_in_seq,
        kv_blocks=table[ids][:, :num_blocks].reshape(-1).long(), context_width=width,
        attn_mask=attn_mask[:, None])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V ([T, Hkv, Dh]) into caches [num_blocks, block_size, Hkv, Dh]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of q [T, H, Dh] over each sequence's cached context -> [T, H * Dh].

    Torch reference path: per layout (decodes, prefill chunks), gather the paged KV into
    padded per-sequence tensors and run one batched SDPA. For GQA the `group = H // Hkv` query
    heads sharing a KV head are folded into the query-length axis, so K/V are never repeated.
    """
    num_tokens, num_heads, head_dim = q.shape
    if len(meta.layouts) == 1 and meta.layouts[0].token_index.numel() == num_tokens:
        return _attend(q, k_cache, v_cache, meta.layouts[0], scale)  # one group: no scatter
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for layout in meta.layouts:
        out[layout.token_index] = _attend(q, k_cache, v_cache, layout, scale)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            layout: AttentionLayout, scale: float) -> torch.Tensor:
    """Attention of one layout's tokens -> [Tg, H * Dh], in the layout's token order.

    For GQA the `group = H // Hkv` query heads sharing a KV head are folded into the query
    axis, so K/V are never repeated.
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs, max_q = layout.query_gather.shape
    shape = (num_seqs, layout.context_width, num_kv_heads, head_dim)
    # A float16 cache under float32 compute (the ONNX Runtime path) is widened after the gather.
    k = k_cache.index_select(0, layout.kv_blocks).view(shape).to(q.dtype)  # [Bg, L, Hkv, Dh]
    v = v_cache.index_select(0, layout.kv_blocks).view(shape).to(q.dtype)  # [Bg, L, Hkv, Dh]
    qp = q[layout.query_gather]  # [Bg, max_q, H, Dh]
    qp = qp.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)  # [Bg, Hkv, g*max_q, Dh]
    out = F.scaled_dot_product_attention(
        qp, k.transpose(1, 2), v.transpose(1, 2), attn_mask=layout.folded_mask(group),
        scale=scale)  # [Bg, Hkv, g*max_q, Dh]
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, num_heads * head_dim)  # [Bg*max_q, H*Dh]
    return out[layout.query_scatter]  # [Tg, H*Dh]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in float32 as HF does, so bf16 runs stay close to the float32 reference.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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


def rope_tables(config: LlamaConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, Dh] in the HF (rotate_half) layout, computed as HF does."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta
                      ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors is not None:  # Llama 3.1+: a factor per frequency
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    inv_freq = inv_freq / config.rope_linear_factor
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh]; cos/sin [T, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchOps:
    """The model's torch backend (the CPU path): the functions above, unfused.

    `kernels.ops.TritonOps` has the same calls, each one fused Triton kernel (the CUDA path).
    """

    name = "torch"

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); x None adds nothing."""
        if x is not None:
            residual = residual + x
        return rms_norm(residual, weight, eps), residual

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) * Dh], cos/sin [T, Dh] -> q [T, H, Dh]; K/V into the caches."""
        num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
        qk_width = (num_heads + num_kv_heads) * head_dim
        # RoPE on Q and K in one pass: [T, H + Hkv, Dh]
        qk = apply_rope(qkv[:, :qk_width].view(num_tokens, -1, head_dim), cos[:, None],
                        sin[:, None])
        q, k = qk[:, :num_heads], qk[:, num_heads:]  # [T, H, Dh], [T, Hkv, Dh]
        v = qkv[:, qk_width:].view(num_tokens, num_kv_heads, head_dim)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q

    attention = staticmethod(paged_attention)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, F]
        return F.silu(gate) * up


def select_ops(kernels: str | None, device: torch.device):
    """None picks by device: Triton kernels on CUDA, torch elsewhere."""
    if kernels is None:
        kernels = "triton" if device.type == "cuda" else "torch"
    if kernels == "torch":
        return TorchOps
    if kernels == "triton":
        from llmbus.services.executor.kernels.ops import TritonOps  # imports triton: CUDA path only

        return TritonOps
    raise ValueError(f"unknown kernels {kernels!r}: expected 'torch' or 'triton'")


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [D]
    qkv: Linear  # [(H + 2 Hkv) * Dh, D], Q/K/V fused: one matmul instead of three
    attn_output: Linear  # [D, H * Dh]
    ffn_norm: torch.Tensor  # [D]
    gate_up: Linear  # [2 F, D], gate and up fused
    down: Linear  # [D, F]
    qkv_bias: torch.Tensor | None = None  # [(H + 2 Hkv) * Dh] (qwen2)


class LlamaModel:
    """Weights plus the forward; the KV cache is passed in (the runner owns it).

    `kernels` picks the backend of the non-matmul ops ("torch" or "triton"; None: by device).
    With `native` (quantized tensors by name, see gguf_loader), each matmul whose weights are
    all there runs a quantized kernel on small steps (see linear.py).
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *,
                 max_positions: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kernels: str | None = None,
                 native: dict[str, NativeWeight] | None = None) -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.ops = select_ops(kernels, self.device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def linear(*names: str) -> Linear:
            """One matmul over the row-stacked weights `names`."""
            parts = [native[n] for n in names if n in native] if native else []
            return make_linear(torch.cat([w(n) for n in names]),
                               parts if len(parts) == len(names) else None)

        self.layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            self.layers.append(_Layer(
                attn_norm=w(p + "attn_norm.weight"),
                qkv=linear(*(p + f"attn_{n}.weight" for n in "qkv")),
                attn_output=linear(p + "attn_output.weight"),
                ffn_norm=w(p + "ffn_norm.weight"),
                gate_up=linear(p + "ffn_gate.weight", p + "ffn_up.weight"),
                down=linear(p + "ffn_down.weight"),
                qkv_bias=None if qkv_bias(weights, i) is None
                else qkv_bias(weights, i).to(device=device, dtype=dtype)))
        self.embed = w("token_embd.weight")  # [V, D]
        head = self.embed if config.tie_word_embeddings else w("output.weight")
        head_native = (native or {}).get("output.weight")
        self.lm_head = make_linear(head, [head_native] if head_native else None, head=True)
        self.output_norm = w("output_norm.weight")
        # Whether some layer matmul reads quantized blocks; "native" then, or for the head alone
        # (for logs and benches).
        self.native_layers = any(not isinstance(m, DenseLinear) for layer in self.layers
                                 for m in (layer.qkv, layer.attn_output, layer.gate_up,
                                           layer.down))
        self.weight_format = ("native" if self.native_layers
                              or not isinstance(self.lm_head, DenseLinear) else "dense")
        self.set_max_positions(max_positions)
        self.scale = config.head_dim ** -0.5

    def set_max_positions(self, max_positions: int) -> None:
        """Size the rotary tables for positions [0, max_positions)."""
        cos, sin = rope_tables(self.config, max_positions)
        self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logits_indices [S] -> float32 logits [S, V].

        Writes this step's K/V into `kv_cache` at `meta.slot_mapping`.
        """
        cfg, ops, eps = self.config, self.ops, self.config.rms_norm_eps
        cos, sin = self.cos[positions], self.sin[positions]  # [T, Dh]
        h = self.embed[input_ids]  # [T, D], the residual stream
        # Each sublayer's output joins the residual inside the next norm (one fused kernel).
        delta: torch.Tensor | None = None  # [T, D]
        for index, layer in enumerate(self.layers):
            x, h = ops.add_rms_norm(h, delta, layer.attn_norm, eps)
            qkv = layer.qkv(x)  # [T, (H + 2 Hkv) * Dh]
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            k_cache, v_cache = kv_cache.layer(index)
            q = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                  cfg.num_heads)  # [T, H, Dh]
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale)  # [T, H * Dh]
            x, h = ops.add_rms_norm(h, layer.attn_output(attn), layer.ffn_norm, eps)
            delta = layer.down(ops.silu_mul(layer.gate_up(x)))
        # Only the positions that sample pay for the norm and the vocab projection.
        tail = None if delta is None else delta[logits_indices]
        h, _ = ops.add_rms_norm(h[logits_indices], tail, self.output_norm, eps)  # [S, D]
        return self.lm_head(h).float()  # [S, V]

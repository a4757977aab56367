"""A plain float64 llama to hold the backends to, and one paged forward through a backend: what
the executor's model tests share."""

from __future__ import annotations

import math

import numpy as np
import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from tests.gguf_fixtures import TinySpec


def reference_logits(w: dict[str, np.ndarray], spec: TinySpec, token_ids: list[int]):
    """Plain float64 llama over the whole sequence: full causal attention, no cache."""
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}
    lm_head = t.get("output.weight", t["token_embd.weight"])
    return reference_hidden(w, spec, token_ids) @ lm_head.T  # [n, V]


def reference_hidden(w: dict[str, np.ndarray], spec: TinySpec, token_ids: list[int]):
    """The float64 llama's final hidden states after the output norm, [n, D] (what an
    embedding pools)."""
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}
    n, dh, group = len(token_ids), spec.head_dim, spec.num_heads // spec.num_kv_heads
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, dh, 2).double() / dh)
    angles = torch.arange(n).double()[:, None] * inv_freq[None]  # [n, dh/2]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]  # [n, 1, dh]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]

    def rope(x):  # [n, heads, dh]
        x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def norm(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + spec.rms_norm_eps)

    x = t["token_embd.weight"][token_ids]  # [n, D]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        h = norm(x, t[p + "attn_norm.weight"])
        q = rope((h @ t[p + "attn_q.weight"].T).view(n, spec.num_heads, dh))
        k = rope((h @ t[p + "attn_k.weight"].T).view(n, spec.num_kv_heads, dh))
        v = (h @ t[p + "attn_v.weight"].T).view(n, spec.num_kv_heads, dh)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
        probs = scores.masked_fill(causal, -math.inf).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        x = x + attn @ t[p + "attn_output.weight"].T
        h = norm(x, t[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(h @ t[p + "ffn_gate.weight"].T)
        x = x + (gate * (h @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
    return norm(x, t["output_norm.weight"])


def paged_forward(model, cache, seqs, block_size: int = 4):
    """One forward over (token_ids, start, end, block_table) per sequence; logits of all tokens."""
    input_ids = [tok for ids, start, end, _ in seqs for tok in ids[start:end]]
    meta = build_attention_metadata([end - start for _, start, end, _ in seqs],
                                    [end for _, _, end, _ in seqs],
                                    [table for *_, table in seqs], block_size)
    ids = torch.tensor(input_ids)
    with torch.inference_mode():
        return model.forward(ids, meta.positions, meta, cache, torch.arange(len(input_ids)))

"""A mixture-of-experts MLP (Qwen3-MoE), as HF transformers computes it, with the tokens
grouped by expert: each expert used in the step runs once, on every token routed to it.

    router:  probs = softmax(x @ Wrᵀ) in float32; the top k per token, renormalised to sum 1
    experts: y[t] = Σ_e∈top(t) w[t, e] · down_e(silu(gate_e(x[t])) · up_e(x[t]))

Experts are taken in ascending order and their outputs added into y in that order, as HF
does, so the float32 sums round alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, router: torch.Tensor,
          top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], router [E, D] -> (weights [T, k] in x's dtype, experts [T, k] int64)."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float)  # [T, E]
    weights, experts = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def moe_mlp(x: torch.Tensor, router: torch.Tensor, expert_mlp: Callable[
        [int, torch.Tensor], torch.Tensor], top_k: int) -> torch.Tensor:
    """x [T, D] -> [T, D]. `expert_mlp(e, rows)` is expert e's MLP on rows [n, D] -> [n, D]."""
    weights, experts = route(x, router, top_k)  # [T, k] each
    flat = experts.flatten()  # [T * k]
    order = flat.argsort(stable=True)  # slots grouped by expert, in token order within one
    counts = torch.bincount(flat, minlength=router.shape[0]).tolist()
    tokens, slot_weights = order // top_k, weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start:start + count]
            y = expert_mlp(expert, x[rows]) * slot_weights[start:start + count, None]
            out.index_add_(0, rows, y)
            start += count
    return out

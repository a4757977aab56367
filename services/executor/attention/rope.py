"""Rotary position embedding tables and their application, as HF computes them."""

from __future__ import annotations

import torch

from llmbus.services.executor.weights.model_config import LlamaConfig


def rope_tables(config: LlamaConfig, max_positions: int,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, Dh] in the HF (rotate_half) layout, computed as HF does.
    `local`: for sliding-window layers with a base of their own (Gemma 3), unscaled."""
    dim = config.head_dim
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not local:
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

"""One embedding per sequence from a flat batch's final hidden states, for encoders and
decoders alike: the mean of a sequence's rows, its first row ([CLS] for BERT), or its last
(a decoder embedder's, e.g. Qwen3-Embedding); then optionally L2-normalised.

The rows of a flat batch are its sequences one after the other (`seq_lens` long), as every
forward of the executor lays them out; padding never enters, so nothing has to be masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

PoolingKind = Literal["mean", "cls", "last"]
POOLING_KINDS: tuple[PoolingKind, ...] = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, seq_lens: Sequence[int], kind: PoolingKind) -> torch.Tensor:
    """hidden [T, D] with T == sum(seq_lens), every length >= 1 -> [B, D], B == len(seq_lens).

    The mean is taken in float32 whatever `hidden`'s dtype, and returned in it.
    """
    if hidden.dim() != 2 or sum(seq_lens) != hidden.shape[0] or min(seq_lens, default=1) < 1:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not hold sequences of lengths "
                         f"{list(seq_lens)} (each at least 1)")
    lens = torch.tensor(list(seq_lens), dtype=torch.int64, device=hidden.device)
    ends = torch.cumsum(lens, 0)  # [B]: one past each sequence's last row
    if kind == "cls":
        return hidden[ends - lens]
    if kind == "last":
        return hidden[ends - 1]
    if kind == "mean":
        owner = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())  # [B, D]
        return (sums / lens.unsqueeze(1).float()).to(hidden.dtype)
    raise ValueError(f"pooling {kind!r} is not one of {', '.join(POOLING_KINDS)}")


def normalize(embeddings: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Each row scaled to unit L2 norm ([B, D] -> [B, D]); a zero row stays zero (its norm is
    clamped to `eps`, as torch.nn.functional.normalize and sentence-transformers do)."""
    return torch.nn.functional.normalize(embeddings, p=2.0, dim=-1, eps=eps)

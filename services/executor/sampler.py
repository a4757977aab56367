"""Token sampling over a batch of logits: greedy, temperature, top-k, top-p, per-request seeds.

A ladder of small steps (parameters -> tensors -> filtered logits -> probabilities -> token),
so penalties, min-p and logprobs can slot in as more rungs. Random draws use the exponential
race (argmax of p / E, E ~ Exp(1)), which samples exactly from p without a cumulative sum and
never picks a zero-probability token. A seeded request draws its noise from its own generator,
so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bus.messages import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors; rows are sequences that sample."""

    temperature: torch.Tensor  # [S] float32; 0 = greedy
    top_k: torch.Tensor  # [S] int64; 0 = off
    top_p: torch.Tensor  # [S] float32; 1 = off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    device: torch.device | str = "cpu") -> SamplingTensors:
        temperature = [max(0.0, p.temperature) for p in params]
        top_k = [max(0, p.top_k) for p in params]
        top_p = [min(1.0, max(0.0, p.top_p)) for p in params]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            all_greedy=all(t == 0.0 for t in temperature),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k largest logits (ties at the k-th value kept); 0 = keep all."""
    vocab_size = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)  # [S]
    max_k = int(k.max())
    top_values = logits.topk(max_k, dim=-1).values  # [S, max_k]
    kth = top_values.gather(1, (k - 1)[:, None])  # [S, 1]
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [S, V]
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False  # the top token always stays (top_p=0 means "most likely only")
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def exponential_noise(shape: tuple[int, int], generators: Sequence[torch.Generator | None],
                      shared: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [S, V]; seeded rows from their own generator, others from `shared`."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < shape[0]:
        noise.exponential_(generator=shared)
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    return noise


def sample(logits: torch.Tensor, tensors: SamplingTensors,
           generators: Sequence[torch.Generator | None],
           shared_generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [S, V] float32 -> token ids [S] int64. `generators[i]` is row i's, or None."""
    greedy = logits.argmax(dim=-1)  # [S]
    if tensors.all_greedy:
        return greedy
    is_greedy = tensors.temperature == 0.0  # [S]
    temperature = torch.where(is_greedy, 1.0, tensors.temperature)
    logits = logits / temperature[:, None]
    if tensors.any_top_k:
        logits = apply_top_k(logits, tensors.top_k)
    if tensors.any_top_p:
        logits = apply_top_p(logits, tensors.top_p)
    probs = logits.softmax(dim=-1)  # [S, V]
    noise = exponential_noise(tuple(probs.shape), generators, shared_generator, probs.device)
    sampled = (probs / noise).argmax(dim=-1)  # [S]
    return torch.where(is_greedy, greedy, sampled)

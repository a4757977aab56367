"""Verifying draft tokens (speculative decoding): which of a request's d guesses the model
agrees with, and the token after them, from the logits at all d + 1 positions of its query.

Greedy: accept drafts while each equals the argmax at its position, then take the argmax at
the first mismatch (or after the last draft): exactly the tokens decoding one by one gives.

Sampling: the drafts come from a lookup, not a distribution, so the draft distribution q is a
point mass and the standard rule (accept draft x with probability min(1, p(x) / q(x)), on
rejection sample from max(0, p - q) renormalized) becomes: accept x with probability p(x), else
sample from p with x removed. Every emitted token is then distributed exactly as p, the
request's own distribution after temperature, top-k, top-p, min-p and logit bias; a seeded
request draws from its own generator, so its output is reproducible.
"""

from __future__ import annotations

import torch

from llmbus.services.executor.sampler import process_logits
from llmbus.services.executor.sampling_tensors import RequestSampling, SamplingTensors
from llmbus.services.executor.truncation import filter_logits


def target_probs(logits: torch.Tensor, sampling: RequestSampling) -> torch.Tensor:
    """The request's sampling distribution at each of logits' rows [R, V] -> [R, V]."""
    tensors = SamplingTensors.build([sampling] * logits.shape[0], logits.device)
    logits = process_logits(logits, tensors)
    if sampling.temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits / sampling.temperature
    return filter_logits(scaled, tensors.top_k, tensors.top_p, tensors.min_p,
                         tensors).softmax(dim=-1)


def verify(logits: torch.Tensor, drafts: list[int], sampling: RequestSampling,
           generator: torch.Generator | None) -> list[int]:
    """logits [d + 1, V] at the last known token and each draft -> the accepted drafts and
    one token more (1 to d + 1 tokens)."""
    if sampling.has_penalties:
        raise ValueError("drafts for a request with penalties (they are never proposed)")
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} logit rows for {len(drafts)} drafts")
    if sampling.temperature == 0.0:
        tensors = SamplingTensors.build([sampling] * logits.shape[0], logits.device)
        best = process_logits(logits, tensors).argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and best[accepted] == drafts[accepted]:
            accepted += 1
        return drafts[:accepted] + [best[accepted]]
    probs = target_probs(logits, sampling)  # [d + 1, V]
    draws = torch.rand(len(drafts), generator=generator, device=logits.device).tolist()
    for j, draft in enumerate(drafts):
        if draws[j] < probs[j, draft].item():
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        token = torch.multinomial(residual, 1, generator=generator).item()
        return drafts[:j] + [token]
    return drafts + [torch.multinomial(probs[-1], 1, generator=generator).item()]

"""Verifying draft tokens (speculative decoding): which of a request's d guesses the model
agrees with, and the token after them, from the logits at all d + 1 positions of its query.

Greedy: accept drafts while each equals the argmax at its position, then take the argmax at
the first mismatch (or after the last draft): exactly the tokens decoding one by one gives.

Sampling: the drafts come from a lookup, not a distribution, so the draft distribution q is a
point mass and the standard rule (accept draft x with probability min(1, p(x) / q(x)), on
rejection sample from max(0, p - q) renormalized) becomes: accept x with probability p(x), else
sample from p with x removed. Every emitted token is then distributed exactly as p, the
request's own distribution after logit bias, min_tokens bans, penalties, temperature, top-k,
top-p and min-p, each as of its position (as if the drafts before it were accepted); a seeded
request draws from its own generator, so its output is reproducible.
"""

from __future__ import annotations

import torch

from llmbus.services.executor.sampling.sampler import process_logits
from llmbus.services.executor.sampling.sampling_tensors import RequestSampling, SamplingTensors
from llmbus.services.executor.sampling.truncation import filter_logits


def position_tensors(sampling: RequestSampling, num_output_tokens: int, drafts: list[int],
                     seen: dict[int, float] | None, device: torch.device | str,
                     ) -> SamplingTensors:
    """Sampling parameters for each of a request's d + 1 verified positions, as if the drafts
    before it were accepted: min_tokens bans lift where they would, and penalties count the
    drafts. `seen`: the request's seen tokens -> output counts (TokenCounts), if penalized."""
    num_rows = len(drafts) + 1
    counts = None
    if seen is not None:
        rows, seen = [], dict(seen)
        for j in range(num_rows):
            rows.append(dict(seen))
            if j < len(drafts):
                seen[drafts[j]] = seen.get(drafts[j], 0.0) + 1.0
        width = max(len(r) for r in rows)
        pads = [[next(iter(r))] * (width - len(r)) for r in rows]  # column 0 again
        counts = (torch.tensor([[*r, *pad] for r, pad in zip(rows, pads, strict=True)],
                               dtype=torch.int64, device=device),
                  torch.tensor([[*r.values(), *(r[t] for t in pad)]
                                for r, pad in zip(rows, pads, strict=True)],
                               dtype=torch.float32, device=device))
    return SamplingTensors.build([sampling] * num_rows, device,
                                 num_output_tokens=[num_output_tokens + j
                                                    for j in range(num_rows)],
                                 penalty_counts=counts)


def target_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """The request's sampling distribution at each of logits' rows [R, V] -> [R, V], one
    row of `tensors` per row (bias, bans and penalties as of that position)."""
    logits = process_logits(logits, tensors)
    if tensors.all_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits / tensors.temperature[:, None]
    return filter_logits(scaled, tensors.top_k, tensors.top_p, tensors.min_p,
                         tensors).softmax(dim=-1)


def verify(logits: torch.Tensor, drafts: list[int], tensors: SamplingTensors,
           generator: torch.Generator | None) -> list[int]:
    """logits [d + 1, V] at the last known token and each draft -> the accepted drafts and
    one token more (1 to d + 1 tokens). `tensors` has a row per position, built as if the
    drafts before it were accepted (min_tokens bans, penalty counts)."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} logit rows for {len(drafts)} drafts")
    if tensors.all_greedy:
        best = process_logits(logits, tensors).argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and best[accepted] == drafts[accepted]:
            accepted += 1
        return drafts[:accepted] + [best[accepted]]
    probs = target_probs(logits, tensors)  # [d + 1, V]
    draws = torch.rand(len(drafts), generator=generator, device=logits.device).tolist()
    for j, draft in enumerate(drafts):
        if draws[j] < probs[j, draft].item():
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        token = torch.multinomial(residual, 1, generator=generator).item()
        return drafts[:j] + [token]
    return drafts + [torch.multinomial(probs[-1], 1, generator=generator).item()]

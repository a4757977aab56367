"""Token sampling over a batch of logits, in vLLM's order:

    raw logits [S, V]
      -> logit bias; min_tokens bans eos and stop ids            process_logits
      -> repetition, frequency, presence penalties               (penalties.py)
      -> greedy rows take the argmax here
      -> temperature -> top-k -> top-p -> min-p                  (truncation.py)
      -> exponential race (in log space)                         draw

Every rung works on the whole batch with per-row parameter tensors; host-side flags skip the
rungs no row needs, so an all-greedy batch without penalties costs one argmax. On CUDA the
sampled rows' ladder and draw run in one Triton program per row (kernels/sampling.py): no sort
and no host sync. Parameters are
normalized once per request (`RequestSampling`), and each step packs them into one tensor.
Truncated rows first work on their top NUM_CANDIDATES tokens (a topk instead of a full sort)
and fall back to whole rows only when those cannot hold their kept set.

Random draws use the exponential race (argmax of p / E, E ~ Exp(1), taken in log space as
argmax of logit - log E), which samples exactly from p without a softmax or a cumulative sum
and never picks a zero-probability token. A seeded request draws its noise from its own
generator, so its tokens do not depend on what else shares the batch. Nothing here mutates its
inputs: the runner takes raw logprobs from the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmbus.services.executor.sampling.sampling_tensors import SamplingTensors
from llmbus.services.executor.sampling.truncation import (
    NUM_CANDIDATES,
    filter_logits,
    truncate_candidates,
)

_NEG_INF = float("-inf")


def process_logits(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Logit bias, min_tokens bans, penalties: logits [S, V] -> a processed copy (or logits)."""
    if tensors.bias is None and tensors.banned is None and tensors.penalties is None:
        return logits
    logits = logits.clone()
    if tensors.bias is not None:
        rows, token_ids, bias = tensors.bias
        logits.index_put_((rows, token_ids), bias, accumulate=True)
    if tensors.banned is not None:
        rows, token_ids = tensors.banned
        logits.index_put_((rows, token_ids), logits.new_full((), _NEG_INF))
    if tensors.penalties is not None:
        tensors.penalties.apply_(logits)
    return logits


def exponential_noise(shape: tuple[int, int], generators: Sequence[torch.Generator | None],
                      shared: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """E ~ Exp(1), [S, V]; seeded rows from their own generator, others from `shared`.

    E = -log(U), U uniform in [0, 1): three times faster than exponential_ on a CPU, and never
    0 (U = 0 gives E = inf, which only makes that token lose the race).
    """
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < shape[0]:
        noise.uniform_(generator=shared)
    for i in seeded:
        noise[i].uniform_(generator=generators[i])
    return noise.log_().neg_()


def race_noise(shape: tuple[int, int], generators: Sequence[torch.Generator | None],
               shared: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """log E for E ~ Exp(1), [S, V] (see exponential_noise)."""
    return exponential_noise(shape, generators, shared, device).log_()


def draw(logits: torch.Tensor, generators: Sequence[torch.Generator | None],
         shared: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of softmax(logits [S, V]) -> [S] int64.

    The exponential race in log space: argmax p / E = argmax logit - log E, so neither a
    softmax nor a cumulative sum is needed, and -inf logits never win.
    """
    noise = race_noise(tuple(logits.shape), generators, shared, logits.device)
    return (logits - noise).argmax(dim=-1)


def sample(logits: torch.Tensor, tensors: SamplingTensors,
           generators: Sequence[torch.Generator | None],
           shared_generator: torch.Generator | None = None,
           num_candidates: int = NUM_CANDIDATES, in_kernel: bool | None = None) -> torch.Tensor:
    """logits [S, V] float32 -> token ids [S] int64. `generators[i]` is row i's, or None.

    Truncated rows sample among their candidates when those provably suffice, the rest over
    whole rows; finding which costs one device sync. Which path a row takes, and how much
    noise its own generator draws, depend only on that row, so a seeded row's tokens ignore
    the rest of the batch. `in_kernel` (default: on CUDA) samples in the Triton kernel instead.
    """
    logits = process_logits(logits, tensors)
    if tensors.all_greedy:
        return logits.argmax(dim=-1)
    if logits.is_cuda if in_kernel is None else in_kernel:
        return sample_in_kernel(logits, tensors, generators, shared_generator)
    greedy = logits.argmax(dim=-1)  # [S]
    # Each path applies the temperature to what it reads: candidates, or whole rows.
    inv_temperature = torch.where(tensors.temperature == 0.0, 1.0,
                                  tensors.temperature).reciprocal()  # [S]
    sampled = greedy
    full_rows = [i for i, g in enumerate(tensors.greedy) if not g and not tensors.truncated[i]]
    if any(tensors.truncated):
        candidates, candidate_ids, fits = truncate_candidates(
            logits, inv_temperature, tensors, num_candidates)  # [S, C], [S, C], [S]
        choice = draw(candidates, [g if t else None for g, t in zip(
            generators, tensors.truncated, strict=True)], shared_generator)  # [S]
        sampled = candidate_ids.gather(1, choice[:, None])[:, 0]
        truncated = torch.tensor(tensors.truncated, device=logits.device)
        full_rows += (truncated & ~fits).nonzero()[:, 0].tolist()
    if full_rows:
        full_rows.sort()
        rows = torch.tensor(full_rows, dtype=torch.int64, device=logits.device)  # [R]
        scaled = logits.index_select(0, rows).mul_(inv_temperature[rows][:, None])  # [R, V]
        filtered = filter_logits(scaled, tensors.top_k[rows], tensors.top_p[rows],
                                 tensors.min_p[rows], tensors)
        tokens = draw(filtered, [generators[i] for i in full_rows], shared_generator)
        sampled = sampled.index_copy(0, rows, tokens)
    return torch.where(tensors.temperature == 0.0, greedy, sampled)


def sample_in_kernel(logits: torch.Tensor, tensors: SamplingTensors,
                     generators: Sequence[torch.Generator | None],
                     shared_generator: torch.Generator | None = None) -> torch.Tensor:
    """The whole ladder and the draw in one Triton program per row, greedy rows included:
    every row reads the full vocabulary once per pass, and nothing waits for the host. The
    same exponential race on the same noise as the torch path's whole-row draw."""
    from llmbus.services.executor.kernels.triton.sampling import sample as sample_rows

    noise = exponential_noise(tuple(logits.shape), generators, shared_generator, logits.device)
    # The step's parameters are columns of one [S, 7] upload: the kernel reads rows densely.
    return sample_rows(logits.contiguous(), noise, tensors.temperature.contiguous(),
                       tensors.top_k.contiguous(), tensors.top_p.contiguous(),
                       tensors.min_p.contiguous())

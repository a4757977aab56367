"""Truncating each row's distribution: top-k, top-p and min-p, over whole rows or candidates.

Sorting whole rows (for top-p) dominates sampling on a CPU, while most rows keep far fewer
tokens than their top few hundred. So `truncate_candidates` first works on a row's top
NUM_CANDIDATES tokens and says which rows those provably suffice for; `filter_logits` does the
same over whole rows for the others. Both keep vLLM v0's order: top-k, top-p, then min-p, on
logits already divided by the temperature.
"""

from __future__ import annotations

import torch

from llmbus.services.executor.sampling.logprobs import logsumexp
from llmbus.services.executor.sampling.sampling_tensors import SamplingTensors

NUM_CANDIDATES = 256
_NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor,
                max_top_k: int | None = None) -> torch.Tensor:
    """Keep each row's top_k largest logits (ties at the k-th value kept); 0 = keep all.

    max_top_k: the largest top_k, if the caller knows it (saves a device sync).
    """
    if max_top_k is None:
        max_top_k = int(top_k.max())
    max_k = max(1, min(max_top_k, logits.shape[-1]))
    top_values = logits.topk(max_k, dim=-1).values  # [S, max_k]
    kth = top_values.gather(1, (top_k.clamp(1, max_k) - 1)[:, None])  # [S, 1]
    kth = kth.masked_fill(top_k[:, None] <= 0, _NEG_INF)  # rows without top-k keep all
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    log_probs = sorted_logits - logsumexp(sorted_logits)[:, None]
    probs = log_probs.clamp_(min=-80.0).exp_()  # no denormals (see logsumexp)
    mass_before = probs.cumsum(dim=-1) - probs  # [S, V]
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False  # the top token always stays (top_p=0 means "most likely only")
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with probability < min_p * the row's top probability; 0 = keep all.

    p_i < min_p * p_max  <=>  logit_i < max_logit + log(min_p), so no softmax is needed.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [S, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Top-k, then top-p, then min-p (vLLM v0's order) over whole rows; [R, V] -> [R, V].

    The flags and max_top_k of `tensors` skip rungs (they may cover more rows than these R).
    """
    if tensors.any_top_k:
        logits = apply_top_k(logits, top_k, tensors.max_top_k)
    if tensors.any_top_p:
        logits = apply_top_p(logits, top_p)
    if tensors.any_min_p:
        logits = apply_min_p(logits, min_p)
    return logits


def truncate_candidates(logits: torch.Tensor, inv_temperature: torch.Tensor,
                        tensors: SamplingTensors, num_candidates: int,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p and min-p on each row's `num_candidates` likeliest tokens.

    logits [S, V] before temperature, inv_temperature [S] -> (filtered candidate logits
    [S, C], their token ids [S, C], fits [S] bool). fits[i] says row i's kept set provably
    lies among its candidates, so drawing from them is exact: C covers the vocabulary, or
    0 < top_k <= C and no tie with the k-th logit lies past them, or top-k is off and they
    hold top_p of the probability or end under the min-p bar. Other rows must be filtered
    over whole rows.
    """
    vocab_size = logits.shape[-1]
    num_candidates = min(num_candidates, vocab_size)
    candidates, candidate_ids = logits.topk(num_candidates, dim=-1)  # [S, C], descending
    candidates = candidates * inv_temperature[:, None]
    top_k, top_p = tensors.top_k, tensors.top_p
    within = (top_k > 0) & (top_k <= num_candidates)  # [S] top-k cuts inside the candidates
    fits = torch.full_like(within, num_candidates == vocab_size)
    last = candidates[:, -1]  # [S] the smallest candidate
    if tensors.any_top_k:
        kth = candidates.gather(1, (top_k.clamp(1, num_candidates) - 1)[:, None])  # [S, 1]
        candidates = candidates.masked_fill(within[:, None] & (candidates < kth), _NEG_INF)
        fits |= within & (last < kth[:, 0])  # unless ties with the k-th go past them
    if tensors.any_top_p:
        # Probabilities over the top-k set where it is inside, else over the whole row.
        log_total = candidates.logsumexp(-1)  # [S]
        if num_candidates < vocab_size and tensors.top_p_only_rows:
            rows = torch.tensor(tensors.top_p_only_rows, device=logits.device)  # [R]
            row_logits = logits if len(rows) == len(logits) else logits.index_select(0, rows)
            log_total = log_total.index_copy(
                0, rows, logsumexp(row_logits, inv_temperature[rows][:, None]))
        probs = (candidates - log_total[:, None]).exp()  # [S, C]
        mass = probs.cumsum(dim=-1)
        drop = mass - probs >= top_p[:, None]
        drop[:, 0] = False
        candidates = candidates.masked_fill(drop, _NEG_INF)
        fits |= (top_k == 0) & (top_p < 1.0) & (mass[:, -1] >= top_p)
    if tensors.any_min_p:
        threshold = candidates[:, 0] + tensors.min_p.log()  # [S]; the top candidate stays
        candidates = candidates.masked_fill(candidates < threshold[:, None], _NEG_INF)
        fits |= (top_k == 0) & (tensors.min_p > 0.0) & (last < threshold)
    return candidates, candidate_ids, fits

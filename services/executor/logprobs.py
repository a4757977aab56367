"""Log-probabilities of sampled tokens, from the model's raw distribution.

Like vLLM's default ("raw logprobs"), they are log_softmax of the logits before logit bias,
penalties, temperature or any filter, so they describe the model, not the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bus.messages import TokenLogprobs

MAX_LOGPROBS = 20  # the most alternatives a request gets (OpenAI's top_logprobs limit)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Each row's chosen-token logprob and its top-k alternatives, sorted most likely first.

    logits [S, V] raw; token_ids [S] int64 sampled; num_logprobs[i] is row i's k (None: row i
    did not ask; k is capped at MAX_LOGPROBS). Returns one entry per row, or [] when no row
    asked, so a step without logprobs costs nothing.
    """
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return []
    ks = [min(max(0, num_logprobs[i] or 0), MAX_LOGPROBS) for i in rows]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [L]
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # [L, V]
    chosen = logprobs.gather(1, token_ids.index_select(0, index)[:, None])[:, 0]  # [L]
    max_k = max(ks)
    top_logprobs, top_ids = [[]] * len(rows), [[]] * len(rows)
    if max_k > 0:
        top = logprobs.topk(max_k, dim=-1)  # sorted, most likely first
        top_logprobs, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for j, (row, k, logprob) in enumerate(zip(rows, ks, chosen.tolist(), strict=True)):
        out[row] = TokenLogprobs(logprob=logprob, top_token_ids=top_ids[j][:k],
                                 top_logprobs=top_logprobs[j][:k])
    return out

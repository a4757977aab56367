"""Log-probabilities of sampled tokens, from the model's raw distribution.

Like vLLM's default ("raw logprobs"), they are log_softmax of the logits before logit bias,
penalties, temperature or any filter, so they describe the model, not the sampler. Only the
chosen and the top-k entries are needed, so they are logit - logsumexp(row), without a
[L, V] log_softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmbus.bus.messages import TokenLogprobs

MAX_LOGPROBS = 20  # the most alternatives a request gets (OpenAI's top_logprobs limit)
_EXP_FLOOR = -80.0  # exp(-80) ~ 2e-35 is still a normal float32


def logsumexp(logits: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """logsumexp(logits [R, V] * scale [R, 1]) over the last dim -> [R]; scale > 0.

    Terms more than 80 below the row's maximum are counted as exp(-80) (a relative error
    under V * 2e-35): real logits span more than that, and exp() producing denormals made
    torch's logsumexp and log_softmax several times slower on a CPU.
    """
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    shifted = logits - top
    if scale is not None:
        shifted *= scale
        top = top * scale
    return shifted.clamp_(min=_EXP_FLOOR).exp_().sum(dim=-1).log_() + top[:, 0]


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
    raw = logits if len(rows) == len(num_logprobs) else logits.index_select(0, index)  # [L, V]
    log_total = logsumexp(raw)[:, None]  # [L, 1]
    chosen = raw.gather(1, token_ids.index_select(0, index)[:, None]) - log_total  # [L, 1]
    max_k = max(ks)
    top_logprobs, top_ids = [[]] * len(rows), [[]] * len(rows)
    if max_k > 0:
        top = raw.topk(max_k, dim=-1)  # sorted, most likely first
        top_logprobs, top_ids = (top.values - log_total).tolist(), top.indices.tolist()
    out: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for j, (row, k, logprob) in enumerate(zip(rows, ks, chosen[:, 0].tolist(), strict=True)):
        out[row] = TokenLogprobs(logprob=logprob, top_token_ids=top_ids[j][:k],
                                 top_logprobs=top_logprobs[j][:k])
    return out

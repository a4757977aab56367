"""Embedding requests in the executor: a prompt's final hidden states pooled into one vector,
chunk by chunk, beside the step's sampling.

An embedding request is a prompt the scheduler schedules like any prefill (in chunks, beside
decodes) but never samples from. After each forward, the rows of its chunk are read back after
the output norm (`Backend.last_hidden`) and folded into its pooling state: a running sum for
`mean`, the first row for `cls`, the last for `last`. The chunk that ends its prompt makes the
vector, which goes back in the StepResult (`embeddings`); normalising and `dimensions` are the
api's. The KV the prompt leaves is a decoder's real KV, so the scheduler may cache it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmbus.bus.messages import PooledEmbedding, ScheduledRequest
from llmbus.services.executor.weights.encoder_config import POOLING_TYPES

POOLING_KINDS = ("mean", "cls", "last")


def model_pooling(metadata: dict[str, Any], override: str | None = None) -> str:
    """The pooling a request asking for the model's default gets: `override` (the executor's
    --pooling), else the file's `<arch>.pooling_type`, else mean (a generation model)."""
    if override:
        return override
    arch = metadata.get("general.architecture", "")
    index = int(metadata.get(f"{arch}.pooling_type", 1))
    kind = POOLING_TYPES[index] if 0 <= index < len(POOLING_TYPES) else "mean"
    return kind if kind in POOLING_KINDS else "mean"  # none, rank: not served


def resolve_pooling(asked: str, default: str) -> str:
    kind = default if asked == "model" else asked
    if kind not in POOLING_KINDS:
        raise ValueError(f"unknown pooling {asked!r}; one of {POOLING_KINDS} or 'model'")
    return kind


@dataclass
class Pooling:
    """One embedding request's pooling so far."""

    kind: str
    num_prompt_tokens: int
    folded: torch.Tensor | None = None  # mean: the sum of the rows so far; else the row

    def fold(self, sched: ScheduledRequest, first_row: int,
             hidden: torch.Tensor) -> PooledEmbedding | None:
        """Take a chunk's rows (`hidden`: every row of the step, after the output norm,
        float32); the vector once the chunk ends the prompt."""
        end = sched.start + sched.num_tokens
        if sched.start == 0:  # from the start again (a preempted request recomputes)
            self.folded = None
        rows = hidden[first_row:first_row + sched.num_tokens]
        if self.kind == "mean":
            total = rows.sum(dim=0)
            self.folded = total if self.folded is None else self.folded + total
        elif self.kind == "cls" and sched.start == 0:
            self.folded = rows[0].clone()
        elif self.kind == "last" and end == self.num_prompt_tokens:
            self.folded = rows[-1].clone()
        if end < self.num_prompt_tokens:
            return None
        assert self.folded is not None  # every kind has folded by the prompt's last chunk
        vector = self.folded / self.num_prompt_tokens if self.kind == "mean" else self.folded
        return PooledEmbedding(sched.sequence_id,
                               vector.to(torch.float32).cpu().numpy().astype("<f4").tobytes())


def pool_step(scheduled: list[ScheduledRequest], starts: list[int],
              pooling_of: Callable[[str], Pooling | None],
              last_hidden: Callable[[torch.Tensor], torch.Tensor]) -> list[PooledEmbedding]:
    """After a forward: fold its embedding chunks (`starts`: each scheduled request's first row
    in the step; `pooling_of`: a sequence's pooling, None if it generates) into their pooling;
    the vectors of those whose prompt ended."""
    chunks = [(sched, starts[i], pooling) for i, sched in enumerate(scheduled)
              if (pooling := pooling_of(sched.sequence_id)) is not None]
    if not chunks:
        return []
    rows = torch.cat([torch.arange(first, first + sched.num_tokens)
                      for sched, first, _ in chunks])
    hidden = last_hidden(rows)  # [rows, D], after the output norm
    vectors, offset = [], 0
    for sched, _, pooling in chunks:
        vector = pooling.fold(sched, offset, hidden)
        offset += sched.num_tokens
        if vector is not None:
            vectors.append(vector)
    return vectors

"""Repetition, frequency and presence penalties, and the token counts they read.

The penalties (vLLM's definitions, applied to raw logits after logit bias and min_tokens):

    repetition r:  for every token seen in the prompt or the output,
                   logit / r if logit > 0 else logit * r
    frequency f:   logit -= f * (count of the token in the output)
    presence p:    logit -= p * (count of the token in the output > 0)

`TokenCounts` keeps, for each request that uses a penalty, its prompt mask and its output
counts as one row of two device slabs. A row is written once from the prompt and then gets one
scatter per sampled token, so a step reads them with a single gather instead of rebuilding
them from token id lists: O(batch x vocab) on the device, O(batch) on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalized logits [P, V] (out of place).

    logits [P, V] float; prompt_mask [P, V] bool; output_counts [P, V] int;
    presence, frequency, repetition [P] float.
    """
    in_output = output_counts > 0  # [P, V]
    factor = torch.where(prompt_mask | in_output, repetition[:, None], 1.0)  # [P, V]
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    counts = output_counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * in_output


@dataclass
class Penalties:
    """The penalized rows of a batch and what their penalties read."""

    rows: torch.Tensor  # [P] int64, rows of the batch that have a penalty
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    prompt_mask: torch.Tensor  # [P, V] bool
    output_counts: torch.Tensor  # [P, V] int32

    def apply_(self, logits: torch.Tensor) -> None:
        """Penalize the rows of `logits` [S, V] in place."""
        if self.rows.numel() == logits.shape[0]:  # rows are 0..S-1 in order: no gather
            logits.copy_(self._penalize(logits))
        else:
            logits.index_copy_(0, self.rows, self._penalize(logits.index_select(0, self.rows)))

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.prompt_mask, self.output_counts, self.presence,
                               self.frequency, self.repetition)


class TokenCounts:
    """Prompt masks and output token counts of the live requests that use penalties.

    Each such request owns one slot (a row of both slabs) from `add` until `release`. The slabs
    double when full and never shrink: their size follows the most penalized requests alive at
    once, at vocab_size * 5 bytes per slot.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 num_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.prompt_mask = torch.zeros(num_slots, vocab_size, dtype=torch.bool,
                                       device=device)  # [N, V]
        self.output_counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32,
                                         device=device)  # [N, V]
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.prompt_mask.shape[0]

    def add(self, prompt_token_ids: Sequence[int],
            output_token_ids: Sequence[int] = ()) -> int:
        """Take a slot for a request with these tokens so far; returns the slot."""
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        device = self.prompt_mask.device
        self.prompt_mask[slot] = False
        self.output_counts[slot] = 0
        if prompt_token_ids:
            ids = torch.tensor(prompt_token_ids, dtype=torch.int64, device=device)
            self.prompt_mask[slot, ids] = True
        if output_token_ids:
            ids = torch.tensor(output_token_ids, dtype=torch.int64, device=device)
            self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [P] int64 -> (prompt_mask [P, V] bool, output_counts [P, V] int32)."""
        return self.prompt_mask.index_select(0, slots), self.output_counts.index_select(0, slots)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per slot: slots [P] int64 (distinct), token_ids [P] int64."""
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    def _grow(self) -> None:
        old = self.num_slots
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self.output_counts = torch.cat([self.output_counts,
                                        torch.zeros_like(self.output_counts)])
        self.free_slots.extend(range(2 * old - 1, old - 1, -1))

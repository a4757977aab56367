"""Repetition, frequency and presence penalties, and the per-request token counts they read.

The penalties (vLLM's definitions, applied to raw logits after logit bias and min_tokens):

    repetition r:  for every token seen in the prompt or the output,
                   logit / r if logit > 0 else logit * r
    frequency f:   logit -= f * (count of the token in the output)
    presence p:    logit -= p * (count of the token in the output > 0)

Only tokens a request has seen are touched, so each penalized request keeps a sparse row: the
distinct token ids of its prompt and output, and how often each came out. A step gathers those
rows and penalizes [P, L] logits (L = the most distinct tokens among them), never [P, V]: a
dense [P, V] pass costs tens of milliseconds per step on a CPU at a 49k vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def apply_penalties_(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     output_counts: torch.Tensor, presence: torch.Tensor,
                     frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """Penalize logits [S, V] in place at the tokens each penalized row has seen.

    rows [P] int64 (distinct); token_ids [P, L] int64, row i's seen tokens, which may repeat
    only as exact copies (same id and count, so every copy writes the same value);
    output_counts [P, L] float32; presence, frequency, repetition [P] float32.
    """
    index = (rows[:, None], token_ids)
    values = logits[index]  # [P, L]
    r = repetition[:, None]
    values = torch.where(values > 0, values / r, values * r)
    values -= frequency[:, None] * output_counts + presence[:, None] * (output_counts > 0)
    logits[index] = values


@dataclass
class Penalties:
    """The penalized rows of one step and what their penalties read."""

    rows: torch.Tensor  # [P] int64, rows of the batch that have a penalty
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    token_ids: torch.Tensor  # [P, L] int64 seen tokens (see TokenCounts.gather)
    output_counts: torch.Tensor  # [P, L] float32

    def apply_(self, logits: torch.Tensor) -> None:
        apply_penalties_(logits, self.rows, self.token_ids, self.output_counts, self.presence,
                         self.frequency, self.repetition)


class TokenCounts:
    """The distinct tokens each live penalized request has seen, with their output counts.

    A request owns one slot from `add` to `release`: a row of two device slabs whose first
    `num_seen(slot)` columns hold its distinct tokens (prompt first, then output tokens as they
    first appear) and their output counts. The host keeps token -> column per slot, so
    recording a step's tokens is O(batch). Slabs double (rows or columns) when full.
    """

    def __init__(self, device: torch.device | str = "cpu", num_slots: int = 8,
                 num_columns: int = 256) -> None:
        self.device = torch.device(device)
        self.token_ids = torch.zeros(num_slots, num_columns, dtype=torch.int64,
                                     device=self.device)  # [N, C]
        self.output_counts = torch.zeros(num_slots, num_columns, dtype=torch.float32,
                                         device=self.device)  # [N, C]
        self.columns: list[dict[int, int]] = [{} for _ in range(num_slots)]
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.token_ids.shape[0]

    def num_seen(self, slot: int) -> int:
        return len(self.columns[slot])

    def add(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()) -> int:
        """Take a slot for a request with these tokens so far; returns the slot."""
        if not self.free_slots:
            self._grow(rows=True)
        slot = self.free_slots.pop()
        distinct = dict.fromkeys(prompt_token_ids)
        columns = self.columns[slot] = {t: c for c, t in enumerate(distinct)}
        self._ensure_columns(len(columns))
        self.output_counts[slot] = 0
        if columns:
            self.token_ids[slot, :len(columns)] = torch.tensor(list(columns), device=self.device)
        for token_id in output_token_ids:
            self.record([slot], [token_id])
        return slot

    def release(self, slot: int) -> None:
        self.columns[slot] = {}
        self.free_slots.append(slot)

    def record(self, slots: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count one output token per slot (slots distinct)."""
        new_slots, new_columns, new_ids, columns = [], [], [], []
        for slot, token_id in zip(slots, token_ids, strict=True):
            seen = self.columns[slot]
            column = seen.get(token_id)
            if column is None:
                column = seen[token_id] = len(seen)
                new_slots.append(slot)
                new_columns.append(column)
                new_ids.append(token_id)
            columns.append(column)
        if new_slots:
            self._ensure_columns(max(new_columns) + 1)
            self.token_ids[self._tensor(new_slots), self._tensor(new_columns)] = \
                self._tensor(new_ids)
        index = (self._tensor(slots), self._tensor(columns))
        self.output_counts.index_put_(index, self.output_counts.new_ones(len(slots)),
                                      accumulate=True)

    def gather(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_ids [P, L], output_counts [P, L]) of these slots, each with num_seen >= 1.

        L is the largest num_seen; a shorter row repeats its column 0 to fill it.
        """
        num_seen = [self.num_seen(s) for s in slots]
        if min(num_seen) < 1:
            raise ValueError("a penalized request has seen no token yet")
        width = max(num_seen)
        columns = torch.arange(width, device=self.device)[None, :]  # [1, L]
        columns = torch.where(columns < self._tensor(num_seen)[:, None], columns, 0)  # [P, L]
        index = (self._tensor(slots)[:, None], columns)
        return self.token_ids[index], self.output_counts[index]

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _ensure_columns(self, num_columns: int) -> None:
        while self.token_ids.shape[1] < num_columns:
            self._grow(rows=False)

    def _grow(self, rows: bool) -> None:
        dim = 0 if rows else 1
        self.token_ids = torch.cat([self.token_ids, torch.zeros_like(self.token_ids)], dim)
        self.output_counts = torch.cat([self.output_counts,
                                        torch.zeros_like(self.output_counts)], dim)
        if rows:
            old = len(self.columns)
            self.columns += [{} for _ in range(old)]
            self.free_slots.extend(range(2 * old - 1, old - 1, -1))

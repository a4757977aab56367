"""Draft tokens for speculative decoding by n-gram lookup (prompt lookup): no second model.

If the last n tokens of a request occurred before in its prompt or output, propose what
followed them there; summaries, edits, extraction and code repeat their context, so those
guesses are often right and the executor verifies k of them in one forward.

Each request keeps an index from every n-gram (n_min..n_max) to the position after its latest
earlier occurrence, updated as tokens arrive: a lookup costs n_max - n_min + 1 dict probes
however long the request is, and a new token n_max - n_min + 1 inserts.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-grams -> where their latest earlier occurrence was followed."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._after: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # n-grams ending before this position are in the index
        self._tokens: list[int] = []  # the request's tokens, as far as seen

    def propose(self, prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the suffix of
        prompt + output. The prompt stays the same and the output only grows between calls;
        only what is new since the last call is copied and indexed."""
        tokens = self._tokens
        if not tokens:
            tokens.extend(prompt)
        tokens.extend(output[len(tokens) - len(prompt):])
        self._extend()
        end = len(tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            start = self._after.get(tuple(tokens[end - n:end]))
            if start is not None:
                return tokens[start:start + k]
        return []

    def _extend(self) -> None:
        """Index the n-grams that end before the last token (each has a continuation)."""
        tokens, last = self._tokens, len(self._tokens) - 1
        for stop in range(max(self._num_indexed, 1), last + 1):  # n-grams tokens[..:stop]
            for n in range(self.n_min, min(self.n_max, stop) + 1):
                self._after[tuple(tokens[stop - n:stop])] = stop
        self._num_indexed = max(self._num_indexed, last + 1)

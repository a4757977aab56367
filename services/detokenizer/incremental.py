"""Incremental detokenization with stop strings, one instance per request.

Byte-level BPE splits one character (emoji, CJK) over several tokens, so decoding token by
token would emit U+FFFD halves. Instead we keep a short window of recent token ids:

    ids:    [ ... context ... | ... already emitted ... | new ids ... ]
                              ^ prefix_offset           ^ read_offset

and emit decode(ids[prefix:end]) minus decode(ids[prefix:read]), where `end` is the last new
token after which the text does not end in U+FFFD (an incomplete character): the tokens after it
wait for the rest of their character. The window only ever spans a few tokens, so a step costs
O(new tokens) whatever the length of the output.

Stop strings are matched on the text: any suffix that could still grow into a stop string is held
back until it cannot; a found stop string ends the output before it (or after it, if asked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context, so the first generated token decodes as it would
# after the prompt (tokenizers that drop a leading space on a bare window need this).
NUM_CONTEXT_TOKENS = 5


@dataclass(frozen=True, slots=True)
class Delta:
    """Text to send to the client for one step; `stopped` means a stop string ended it."""

    text: str
    stopped: bool = False


def find_stop(text: str, stop: Sequence[str]) -> tuple[int, int] | None:
    """`(start, end)` of the stop string occurrence in `text` that ends first.

    Ending first is what a stream sees first, so the answer does not depend on how the text was
    cut into steps. Among occurrences ending at the same place, the longest (earliest) wins.
    """
    best: tuple[int, int] | None = None
    for s in stop:
        start = text.find(s)
        if start >= 0 and (best is None or (start + len(s), start) < (best[1], best[0])):
            best = (start, start + len(s))
    return best


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas.

    `decode(ids)` must skip special tokens and decode an incomplete trailing character to
    U+FFFD (`GGUFTokenizer.decode` does both). After `stopped`, further steps return nothing.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], *,
                 prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._decode = decode
        # An empty stop string would end every request before its first character: ignore it.
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        # Only the window from prefix_offset on is kept: older ids never matter again.
        self._ids = list(prompt_ids[-NUM_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._held = ""  # decoded text not yet sent: it might be the start of a stop string
        self.stopped = False
        self.num_tokens = 0

    def step(self, new_ids: Sequence[int]) -> Delta:
        """Feed the request's next token ids; returns the text they complete."""
        if self.stopped:
            return Delta("", stopped=True)
        self.num_tokens += len(new_ids)
        self._ids.extend(new_ids)
        return self._release(self._decode_window(final=False), final=False)

    def finish(self) -> Delta:
        """The request ended for another reason (EOS, length, abort): flush held-back text.

        An incomplete trailing character comes out as U+FFFD, as in a full decode. A stop string
        can still be found here, when the flushed text completes one.
        """
        if self.stopped:
            return Delta("", stopped=True)
        return self._release(self._decode_window(final=True), final=True)

    def _decode_window(self, final: bool) -> str:
        """The text up to the last new token that ends a character (all of it when final):
        where text stops depends on the tokens alone, not on how they came in steps, so a
        copy that replays a dead one's tokens in one step stands where that one stood."""
        prefix_text = self._decode(self._ids[:self._read_offset])
        for end in range(len(self._ids), self._read_offset, -1):
            text = self._decode(self._ids[:end])
            if final or not text.endswith(REPLACEMENT_CHAR):
                break
        else:
            return ""
        if len(text) <= len(prefix_text):
            return ""
        # What is read up to `end` ends on a character boundary: it becomes the next prefix.
        del self._ids[:self._read_offset]
        self._read_offset = end - self._read_offset
        return text[len(prefix_text):]

    def _release(self, new_text: str, final: bool) -> Delta:
        if not self._stop:
            return Delta(new_text)
        # A stop string ending in new_text starts inside held + new_text: anything earlier that
        # could begin one was held back (see partial_stop_len).
        text = self._held + new_text
        found = find_stop(text, self._stop)
        if found is not None:
            self.stopped = True
            self._held = ""
            start, end = found
            return Delta(text[:end] if self._include_stop else text[:start], stopped=True)
        num_held = 0 if final else partial_stop_len(text, self._stop)
        self._held = text[len(text) - num_held:]
        return Delta(text[:len(text) - num_held])

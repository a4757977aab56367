"""Reasoning output: a thinking model's text split at `<think>...</think>` into the reasoning
and the answer, as vLLM's reasoning parsers return them (`reasoning_content` and `content`).

The tokenizer stage decides per chat whether to split (its `--reasoning-parser`, from the
model's chat template) and whether the prompt already opened the think block (DeepSeek-R1's
template ends in `<think>`, so the output starts inside it); the api splits each choice's text
as it streams. Pure: text in, text out.

    output:  [ws] <think> reasoning ... </think> [ws] content ...
             START │      REASONING          │  AFTER │ CONTENT

Output that does not open with `<think>` is all content (Qwen3 with thinking off writes an
empty think block into the prompt instead). Text that may still be the start of a tag is held
back until it is known, so no tag ever reaches a client in pieces.
"""

from __future__ import annotations

from enum import Enum

from llmbus.services.think_tags import THINK_END, THINK_START


class _State(Enum):
    START = 0  # nothing but whitespace yet: thinking or not is still open
    REASONING = 1
    AFTER = 2  # just past </think>: whitespace before the answer is dropped
    CONTENT = 3


def _partial_tag_at_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (may complete with more text)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """One choice's text, fed delta by delta; each call returns (reasoning, content) to send."""

    def __init__(self, opened: bool = False) -> None:
        self.state = _State.REASONING if opened else _State.START
        self.held = ""
        self.thought = opened  # the output had a think block

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        if self.state is _State.START:
            start = self.held.lstrip()
            if start.startswith(THINK_START):
                self.state, self.held = _State.REASONING, start[len(THINK_START):]
                self.thought = True
            elif not THINK_START.startswith(start):
                self.state = _State.CONTENT  # held whitespace included: no think block
        if self.state is _State.REASONING:
            end = self.held.find(THINK_END)
            if end < 0:
                keep = _partial_tag_at_end(self.held, THINK_END)
                reasoning = self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(THINK_END):]
            self.state = _State.AFTER
        if self.state is _State.AFTER:
            self.held = self.held.lstrip()
            if self.held:
                self.state = _State.CONTENT
        if self.state is _State.CONTENT:
            content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the choice ends: a partial tag is text after all."""
        held, self.held = self.held, ""
        if self.state is _State.REASONING:
            return held, ""
        return "", held if self.state is not _State.AFTER else ""


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole choice's (reasoning or None when it did not think, content)."""
    splitter = ReasoningSplitter(opened)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.thought else None), content + more_content

"""Reasoning output split at the think tags (services/api/reasoning.py), streamed in any
pieces: the same split as the whole text's, no tag reaching a client, whitespace between
reasoning and answer dropped."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbus.services.api.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    # output, prompt opened the block, (reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("\nLet me see.\n", "Paris.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Paris.", False, (None, "Paris.")),
    ("  Paris <think> is not a tag here", False, (None, "  Paris <think> is not a tag here")),
    ("Let me see.</think>Paris.", True, ("Let me see.", "Paris.")),  # DeepSeek-R1 style
    ("<think>still thinking when max_tokens hit </thi", False,
     ("still thinking when max_tokens hit </thi", "")),
    ("<think>a</think>", False, ("a", "")),
    ("<thi", False, (None, "<thi")),  # ended while it might have become a tag
    ("", False, (None, "")),
]


@pytest.mark.parametrize(("text", "opened", "want"), CASES)
def test_a_whole_output_splits_at_the_tags(text, opened, want):
    assert split_reasoning(text, opened) == want


def _streamed(pieces: list[str], opened: bool) -> tuple[list[str], list[str]]:
    splitter = ReasoningSplitter(opened)
    reasoning, content = [], []
    for piece in [*pieces, None]:
        r, c = splitter.feed(piece) if piece is not None else splitter.finish()
        reasoning.append(r)
        content.append(c)
    return reasoning, content


@pytest.mark.parametrize(("text", "opened", "want"), CASES)
def test_one_character_at_a_time_gives_the_same_split(text, opened, want):
    reasoning, content = _streamed(list(text), opened)
    assert "".join(reasoning) == (want[0] or "")
    assert "".join(content) == want[1]
    if "not a tag" not in text:  # a tag is never sent in one piece nor in several
        assert all(p in ("", "<", "<thi", "</thi") or "<" not in p
                   for p in reasoning + content), (reasoning, content)


@given(st.lists(st.integers(0, 60), max_size=8), st.sampled_from(CASES))
def test_any_cut_into_pieces_gives_the_same_split(cuts, case):
    text, opened, (want_reasoning, want_content) = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    reasoning, content = _streamed(pieces, opened)
    assert "".join(content) == want_content
    assert "".join(reasoning) == (want_reasoning or "")


def test_reasoning_streams_before_its_end_tag_arrives():
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>I wonder") == ("I wonder", "")
    assert splitter.feed(" about this</") == (" about this", "")  # `</` held: a tag's start
    assert splitter.feed("think>\n\n") == ("", "")  # the whitespace before the answer, dropped
    assert splitter.feed("Yes.") == ("", "Yes.")
    assert splitter.finish() == ("", "")

"""Incremental detokenization and stop strings, with the default model's tokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmbus.services.detokenizer.incremental import (
    Delta,
    IncrementalDetokenizer,
    find_stop,
    partial_stop_len,
)
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import default_model_path

MODEL_PATH = default_model_path()

TEXTS = [
    "Plain ASCII text, nothing special.",
    "Emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵!",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "Café naïve résumé Ångström Straße — “quotes” … ½ ²",
    "mixed😀日本é\n\n  spaces 12345 <b>tags</b>",
]

# Pieces that byte-level BPE cuts inside characters, mixed with plain ones.
FRAGMENTS = ["😀", "👍🏽", "🇫🇷", "日本", "語", "한국어", "é", "ñ", "ß", "Ω", "—", "…", " ", "\n",
             "a", "the", " cat", "ing", ".", ",", "1", "42", "<", ">", "Paris", "!"]


@pytest.fixture(scope="module")
def tokenizer() -> GGUFTokenizer:
    if not MODEL_PATH.is_file():
        pytest.skip(f"default model missing: {MODEL_PATH}")
    return GGUFTokenizer.from_gguf(MODEL_PATH)


def chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def run(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[str], bool]:
    """Feed the chunks until a stop; returns every delta text (the flush last) and `stopped`."""
    texts = []
    for chunk in chunks:
        delta = detok.step(chunk)
        texts.append(delta.text)
        if delta.stopped:
            return texts, True
    delta = detok.finish()
    texts.append(delta.text)
    return texts, delta.stopped


def reference_stop(text: str, stop: list[str], include: bool) -> tuple[str, bool]:
    """What a reader sees char by char: cut at the first position where a stop string ends."""
    for end in range(len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end] if include else text[:end - len(s)], True
    return text, False


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_deltas_concatenate_to_full_decode(tokenizer, text, seed):
    ids = tokenizer.encode(text)
    chunks = [[i] for i in ids] if seed is None else chunked(ids, random.Random(seed))
    texts, stopped = run(IncrementalDetokenizer(tokenizer.decode), chunks)
    assert not stopped
    assert "".join(texts) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in t for t in texts)


@pytest.mark.model
def test_special_tokens_are_skipped_and_prompt_gives_context(tokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    ids = tokenizer.encode("Hi 😀<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer.decode, prompt_ids=prompt)
    texts, _ = run(detok, [[i] for i in ids])
    assert "".join(texts) == "Hi 😀"
    assert detok.num_tokens == len(ids)


@pytest.mark.model
def test_truncated_character_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # the emoji's last byte never arrives
    texts, _ = run(IncrementalDetokenizer(tokenizer.decode), [[i] for i in ids])
    assert "".join(texts) == tokenizer.decode(ids)
    assert texts[-1].endswith("\ufffd") and not any("\ufffd" in t for t in texts[:-1])


@pytest.mark.model
def test_window_stays_small(tokenizer):
    """Each step decodes a few recent tokens, never the whole output."""
    ids = tokenizer.encode(" ".join(TEXTS) * 20)
    window_sizes = []

    def decode(window):
        window_sizes.append(len(window))
        return tokenizer.decode(window)

    texts, _ = run(IncrementalDetokenizer(decode), [[i] for i in ids])
    assert "".join(texts) == tokenizer.decode(ids)
    assert len(ids) > 1000 and max(window_sizes) <= 8


@pytest.mark.model
def test_stop_string_held_back_then_matched(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris. It is big.")
    detok = IncrementalDetokenizer(tokenizer.decode, stop=["Paris.", "London"])
    deltas = [detok.step([i]) for i in ids]
    emitted = "".join(d.text for d in deltas)
    assert emitted == "The capital of France is "
    assert [d.stopped for d in deltas].index(True) == ids.index(30)  # stops on the "." token
    assert detok.step([504]) == Delta("", stopped=True)
    assert detok.finish() == Delta("", stopped=True)


@pytest.mark.model
def test_possible_stop_prefix_flushed_on_finish(tokenizer):
    ids = tokenizer.encode("Go to Par")
    detok = IncrementalDetokenizer(tokenizer.decode, stop=["Paris"],
                                   include_stop_str_in_output=True)
    assert "".join(detok.step([i]).text for i in ids) == "Go to "
    assert detok.finish() == Delta("Par")


def test_find_stop_prefers_first_ending_occurrence():
    assert find_stop("abcd", ["abcd", "bc"]) == (1, 3)
    assert find_stop("xabc", ["bc", "abc"]) == (1, 4)
    assert find_stop("abc", ["zz"]) is None
    assert partial_stop_len("hello wor", ["world", "or"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("ab", ["abc", "b"]) == 2


def test_empty_stop_string_is_ignored():
    detok = IncrementalDetokenizer(lambda ids: "".join(map(chr, ids)), stop=["", "c"])
    assert detok.step([ord("a"), ord("b")]) == Delta("ab")
    assert detok.step([ord("c")]) == Delta("", stopped=True)


@st.composite
def texts_and_stops(draw):
    text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=25)))
    stop = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):  # a piece of the text: often crosses token boundaries
            start = draw(st.integers(0, len(text) - 1))
            stop.append(text[start:start + draw(st.integers(1, 6))])
        else:
            stop.append("".join(draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1,
                                              max_size=3))))
    return text, stop


@pytest.mark.model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=texts_and_stops(), include=st.booleans(), seed=st.integers(0, 2**16))
def test_stop_strings_property(tokenizer, case, include, seed):
    text, stop = case
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer.decode, stop=stop,
                                   include_stop_str_in_output=include)
    texts, stopped = run(detok, chunked(ids, random.Random(seed)))
    expected, expected_stopped = reference_stop(tokenizer.decode(ids), stop, include)
    assert "".join(texts) == expected
    assert stopped == expected_stopped
    assert not any("\ufffd" in t for t in texts)


@pytest.mark.model
def test_a_copy_taking_over_keeps_the_text_held_back_for_a_stop_string(tokenizer):
    """A detokenizer copy dies while it holds back "Par" (it might start the stop string
    "Paris"); the copy taking the completion over replays the dead copy's tokens, so the
    client still gets "Parade", and every character exactly once."""
    from llmbus.bus.messages import CompletionStart, FinishReason, RequestTokens, TokenBatch
    from llmbus.services.detokenizer.detokenization import Detokenization

    ids = tokenizer.encode("We went to the Parade today.")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("Par"))

    def item(new: list[int], replay: list[int] = (), finish=FinishReason.NONE):
        start = CompletionStart(reply_subject="api", stop=["Paris"],
                                replay_token_ids=list(replay))
        return TokenBatch(engine_id="e0", items=[RequestTokens(
            request_id="r", new_token_ids=new, finish_reason=finish, start=start,
            num_before=len(replay))])

    def text(deltas: dict) -> str:
        return "".join(d.text for d in deltas.get("api", []))

    dying = Detokenization(tokenizer)
    before = text(dying.process(item(ids[:cut])).deltas)
    assert before == "We went to the "  # "Par" held back
    survivor = Detokenization(tokenizer)
    after = text(survivor.process(item(ids[cut:], replay=ids[:cut],
                                       finish=FinishReason.LENGTH)).deltas)
    assert before + after == "We went to the Parade today."


@pytest.mark.model
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_copy_taking_over_inside_a_character_sends_each_character_once(tokenizer, seed):
    """The copy dies after tokens whose last character is still incomplete (its text held
    back): the copy taking over replays every token the dead one had, however they came to
    it, and the client gets each character exactly once (a replay that ended inside a
    character used to send the text before it again)."""
    text = "Hi 😀 and 日本語 👍🏽!"
    ids = tokenizer.encode(text)
    for cut in range(1, len(ids)):
        dying = IncrementalDetokenizer(tokenizer.decode)
        before = "".join(dying.step(chunk).text
                         for chunk in chunked(ids[:cut], random.Random(seed)))
        survivor = IncrementalDetokenizer(tokenizer.decode)
        survivor.step(ids[:cut])  # the replay: silent
        after = survivor.step(ids[cut:]).text + survivor.finish().text
        assert before + after == text, (cut, before, after)

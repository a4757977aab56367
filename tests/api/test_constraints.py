"""Constrained decoding without a model: exact masks over a tiny vocabulary, how masks are
applied to logits, the constraint checks the api answers with a 400, and tool-call parsing."""

from __future__ import annotations

import json

import pytest
import torch

from llmbus.bus.messages import StructuredOutput
from llmbus.services.api.generation import _opens_calls
from llmbus.services.executor.sampling.constraints import Grammars, Vocabulary, allowed, apply_masks
from llmbus.services.structured_output import ConstraintError, check
from llmbus.services.tool_calls import calls_schema, parse_calls, template_messages

EOS = 0
TOKENS = [b"<eos>", b"a", b"b", b"ab", b"{", b"}", b'"', b"x", b"1", b"bb", b"<pad>"]
VOCAB_SIZE = 40  # the model's logits are wider than the vocabulary, as often


def _encode(text: str) -> list[int]:
    """Greedy longest match over TOKENS (what llguidance asks a tokenizer for)."""
    out, i = [], 0
    while i < len(text):
        for length in (2, 1):
            piece = text[i:i + length].encode()
            if piece in TOKENS[1:]:
                out.append(TOKENS.index(piece))
                i += length
                break
        else:
            raise ValueError(f"cannot tokenize {text!r}")
    return out


def tiny_grammars() -> Grammars:
    padding = list(range(len(TOKENS), VOCAB_SIZE))
    return Grammars(lambda: Vocabulary(
        TOKENS + [b""] * len(padding), [EOS, 10, *padding], [EOS], _encode), VOCAB_SIZE)


def allowed_ids(grammars: Grammars, matcher) -> list[int]:
    return allowed(grammars.bitmask([matcher]), VOCAB_SIZE)[0].nonzero()[:, 0].tolist()


def test_regex_masks_are_exact_and_follow_the_tokens():
    grammars = tiny_grammars()
    matcher = grammars.matcher(StructuredOutput(kind="regex", spec="ab*"))
    assert allowed_ids(grammars, matcher) == [1, 3]  # "a", "ab"; never "b", specials, padding
    assert matcher.consume_token(3)
    assert allowed_ids(grammars, matcher) == [EOS, 2, 9]  # more b's, or the end
    assert matcher.consume_token(EOS)
    assert matcher.is_stopped()


def test_choice_allows_only_the_choices_and_then_only_the_end():
    grammars = tiny_grammars()
    matcher = grammars.matcher(StructuredOutput(kind="choice", spec=json.dumps(["x1", "b"])))
    assert allowed_ids(grammars, matcher) == [2, 7]
    matcher.consume_token(7)
    assert allowed_ids(grammars, matcher) == [8]
    matcher.consume_token(8)
    assert allowed_ids(grammars, matcher) == [EOS]


def test_each_request_gets_its_own_matcher_from_one_compiled_grammar():
    grammars = tiny_grammars()
    spec = StructuredOutput(kind="regex", spec="ab*")
    first, second = grammars.matcher(spec), grammars.matcher(spec)
    first.consume_token(3)
    assert allowed_ids(grammars, second) == [1, 3]  # untouched by the first
    assert len(grammars._cache) == 1


def test_a_failed_matcher_allows_only_the_end():
    grammars = tiny_grammars()
    matcher = grammars.matcher(StructuredOutput(kind="regex", spec="ab*"))
    matcher.consume_token(7)  # "x": refused, the matcher is now in its error state
    assert matcher.is_error()
    assert allowed_ids(grammars, matcher) == [EOS]


def test_a_constraint_that_does_not_compile_is_refused_by_the_executor_too():
    with pytest.raises(ConstraintError, match="regex"):
        tiny_grammars().prepare(StructuredOutput(kind="regex", spec="a(b", param="guided_regex"))


def test_a_vocabulary_that_cannot_be_read_refuses_constraints_clearly():
    def unreadable() -> Vocabulary:
        raise ValueError("tokenizer model 'bert' is not supported")

    grammars = Grammars(unreadable, VOCAB_SIZE)
    with pytest.raises(ConstraintError, match="not available for this model's vocabulary"):
        grammars.prepare(StructuredOutput(kind="json_object", param="response_format"))


def test_bit_31_of_a_word_is_a_token_like_any_other():
    mask = torch.tensor([[-(1 << 31), 1]], dtype=torch.int32)  # bits 31 and 32 set
    assert allowed(mask, 64)[0].nonzero()[:, 0].tolist() == [31, 32]


def test_masks_change_only_the_constrained_rows_of_a_copy():
    logits = torch.randn(3, 40)
    before = logits.clone()
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    out = apply_masks(logits, [1], bitmask)
    assert torch.equal(logits, before)  # raw logits stay for logprobs
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.isfinite(out[1]).nonzero()[:, 0].tolist() == [1, 3]
    assert torch.equal(out[1, [1, 3]], before[1, [1, 3]])


@pytest.mark.parametrize(("kind", "spec", "says"), [
    ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ("json_schema", '{"type": "strin"}', "strin"),
    ("json_schema", "{not json", "invalid json schema"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("regex", "a(b", "unclosed group"),
    ("grammar", 'root ::= "a" missing', "missing"),
    ("grammar", "start: nowhere", "nowhere"),
    ("choice", "[]", "non-empty"),
])
def test_bad_constraints_are_named(kind, spec, says):
    with pytest.raises(ConstraintError) as raised:
        check(StructuredOutput(kind=kind, spec=spec, param="p"))
    assert says in str(raised.value) and raised.value.param == "p"


@pytest.mark.parametrize(("kind", "spec"), [
    ("json_object", ""), ("json_schema", '{"type": "object", "properties": {"a": {}}}'),
    ("regex", r"\d{3}-\d{4}"), ("choice", '["yes", "no \\"quoted\\""]'),
    ("grammar", 'root ::= "yes" | "no"'), ("grammar", 'start: "a"+'),
])
def test_good_constraints_pass(kind, spec):
    check(StructuredOutput(kind=kind, spec=spec))


FUNCTIONS = [{"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time"}]


def test_calls_are_read_in_every_format_and_only_for_known_functions():
    names = {"get_weather", "get_time"}
    calls = parse_calls('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                        '{"name": "get_time", "arguments": {}}]', names)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    hermes = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert [c.name for c in parse_calls(hermes, names)] == ["get_time"]
    llama = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert json.loads(parse_calls(llama, names)[0].arguments) == {"city": "Rome"}
    assert parse_calls("It is sunny.", names) is None
    assert parse_calls('[{"name": "rm_rf", "arguments": {}}]', names) is None
    assert parse_calls('[{"name": "get_time", "arguments": [1]}]', names) is None
    assert parse_calls('[{"name": ["get_time"], "arguments": {}}]', names) is None  # no 500
    assert parse_calls("Sure. <tool_call>" + hermes.removeprefix("<tool_call>"), names) is None


@pytest.mark.parametrize(("start", "opens"), [
    ("[", True), ('{"name"', True), ("<tool_call>", True), ("<tool", None), ("<", None),
    ("<think>", False), ("<a href", False), ("Hello", False)])
def test_streaming_holds_text_only_while_it_may_open_calls(start, opens):
    assert _opens_calls(start) is opens


def test_the_calls_schema_is_a_grammar_that_compiles():
    for parallel in (True, False):
        schema = calls_schema(FUNCTIONS, parallel)
        check(StructuredOutput(kind="json_schema", spec=json.dumps(schema)))
        assert ("maxItems" in schema) is not parallel


def test_earlier_calls_are_shown_to_templates_with_and_without_a_tool_format():
    messages = [{"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}]
    native = template_messages(messages, template_has_tools=True)[0]
    assert native["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    written = template_messages(messages, template_has_tools=False)[0]
    assert "tool_calls" not in written
    assert json.loads(written["content"]) == [{"name": "get_time", "arguments": {"zone": "UTC"}}]

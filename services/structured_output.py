"""Output constraints (JSON schema, any JSON object, regex, a choice of strings, a grammar) as
llguidance grammars, and their checks.

llguidance rather than xgrammar, measured with `python -m llmbus.bench.grammar_libraries`
(docs/benchmarks.md, "Structured output"): it compiles a 20-property schema 15x faster, names
the schema keywords it does not implement, and needs nothing else installed (xgrammar imports
transformers and pulls in triton); xgrammar fills a batch's masks faster, but both cost well
under a step's forward on a CPU.

Shared by the api, which checks a constraint before it admits the request (a 400 naming what is
wrong, no tokenizer needed), and the executor, which compiles it against the vocabulary and
masks the logits (services/executor/constraints.py).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

from llmbus.bus.messages import StructuredOutput

if TYPE_CHECKING:  # declared only in llguidance's stubs
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as models write it when asked, `{"a": 1, "b": [2, 3]}`, with no free whitespace: a
# small model at temperature 1 can otherwise spend every token on spaces and newlines.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message says why (and `param` where)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_of(structured: StructuredOutput) -> str:
    """The llguidance grammar (JSON text) of a constraint; ConstraintError if it has none."""
    kind, spec, param = structured.kind, structured.spec, structured.param
    matcher = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            schema = json.loads(spec)
            if not isinstance(schema, dict):
                raise ConstraintError("the JSON schema must be an object", param)
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return matcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) for c in choices)):
                raise ConstraintError("the choices must be a non-empty list of strings", param)
            # Lark string literals take JSON's escapes.
            return matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        if kind == "grammar":
            return matcher.grammar_from_lark(_lark(spec, param) if "::=" in spec else spec)
    except ConstraintError:
        raise
    except (ValueError, TypeError) as exc:  # JSON that does not parse
        raise ConstraintError(f"invalid {kind.replace('_', ' ')}: {exc}", param) from None
    raise ConstraintError(f"unknown constraint kind {kind!r}; expected one of "
                          f"{', '.join(KINDS)}", param)


def _lark(gbnf: str, param: str) -> str:
    """llama.cpp's GBNF (`root ::= ...`) in Lark, the syntax llguidance reads."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(gbnf)
    except Exception as exc:  # the converter raises bare Exceptions for grammar errors
        raise ConstraintError(f"invalid GBNF grammar: {exc}", param) from None


def check(structured: StructuredOutput) -> None:
    """ConstraintError unless the constraint compiles (its grammar alone, no vocabulary):
    an invalid schema, a keyword llguidance does not implement (named in the message), a regex
    or grammar that does not parse."""
    grammar = grammar_of(structured)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        what = {"json_schema": "JSON schema", "json_object": "JSON object grammar",
                "regex": "regex", "choice": "choice", "grammar": "grammar"}[structured.kind]
        raise ConstraintError(f"unsupported or invalid {what}: {messages[0].strip()}",
                              structured.param)

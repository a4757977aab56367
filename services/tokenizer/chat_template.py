"""Render a model's chat template (jinja2) into prompt text, the way transformers does.

Chat templates are untrusted code shipped inside model files, hence the sandbox. The environment
mirrors transformers' `apply_chat_template(..., tokenize=False)` so that the same conversation
gives the same prompt, and therefore the same tokens, here and in the reference implementation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed on it."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Some templates (Llama 3) put today's date in the system prompt.
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, a route to CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no `self`, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template source; rendering is then cheap per request."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = False, bos_token: str | None = None,
                         eos_token: str | None = None, **context: Any) -> str:
    """The prompt text for `messages` (dicts with at least `role` and `content`).

    Keys whose value is None are dropped first, as transformers does: OpenAI clients send
    `content: null` next to tool calls, and templates test for a missing key, not for None.
    Extra keyword arguments (`tools`, `documents`, ...) are passed to the template.
    """
    plain = [{key: value for key, value in message.items() if value is not None}
             for message in messages]
    # An unset special token stays undefined (renders as ""), as in transformers.
    tokens = {name: value for name, value in (("bos_token", bos_token), ("eos_token", eos_token))
              if value is not None}
    context = {"tools": None, "documents": None, **tokens, **context}
    try:
        return compile_chat_template(source).render(
            messages=plain, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc

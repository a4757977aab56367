"""The tokenizer stage's pure core: prompt text or chat messages to token ids, checked against
the vocabulary. No bus, no spans (the adapter, service.py, records those)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llmbus.bus.messages import ChatMessage, EncodeRequest, GenerateRequest
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.think_tags import THINK_END, THINK_START
from llmbus.services.tokenizer.chat_template import render_chat_template
from llmbus.services.tool_calls import function_of, template_messages, tools_system_prompt

_USES_TOOLS = re.compile(r"\btools\b")  # a template that renders `tools` itself
# What llmbus itself gives the template; `chat_template_kwargs` may not set these.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt",
                               "bos_token", "eos_token")
REASONING_PARSERS = ("auto", "think", "none")


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    # The output is to be split at the think tags (a chat, the parser on), and whether the
    # prompt already opened the think block (DeepSeek-R1's template ends in `<think>\n`).
    reasoning: bool = False
    reasoning_open: bool = False
    # Where a structured output's constraint starts: after the reasoning (`</think>`) where
    # the model thinks first, "" where it answers at once (the template closed the block).
    constraint_after: str = ""


class Tokenization:
    """Prompt text or messages -> token ids, with the model's own template and vocabulary.

    `reasoning_parser`: "think" splits every chat's output at `<think>`/`</think>` into
    reasoning and content (the api does, services/api/reasoning.py); "auto" does so where the
    file's chat template writes `<think>` (Qwen3, DeepSeek-R1 distills, QwQ); "none" never.
    """

    def __init__(self, tokenizer: GGUFTokenizer, reasoning_parser: str = "auto") -> None:
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {reasoning_parser!r}: expected one of "
                             f"{', '.join(REASONING_PARSERS)}")
        self.tokenizer = tokenizer
        self.reasoning = reasoning_parser == "think" or (
            reasoning_parser == "auto" and THINK_START in (tokenizer.chat_template or ""))

    def check_token_ids(self, token_ids: list[int], what: str = "token id") -> None:
        bad = [t for t in token_ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad[0]} is outside the vocabulary "
                             f"(0..{self.tokenizer.vocab_size - 1})")

    def prompt_token_ids(self, request: GenerateRequest | EncodeRequest) -> list[int]:
        """Raises ValueError with a client-facing message on bad input."""
        return self.prompt(request).token_ids

    def prompt(self, request: GenerateRequest | EncodeRequest) -> Prompt:
        """The prompt's token ids and how its output is parsed; raises ValueError with a
        client-facing message on bad input."""
        tok = self.tokenizer
        if isinstance(request, GenerateRequest) and request.prompt_token_ids is not None:
            self.check_token_ids(request.prompt_token_ids)
            return Prompt(list(request.prompt_token_ids))
        if request.messages:
            if not tok.chat_template:
                raise ValueError("this model has no chat template; use /v1/completions")
            tools = json.loads(getattr(request, "tools_json", "") or "null")
            has_tools = bool(_USES_TOOLS.search(tok.chat_template))
            messages = template_messages([_as_dict(m) for m in request.messages], has_tools)
            if tools and not has_tools:
                messages = _with_system_prompt(
                    messages, tools_system_prompt([function_of(t) for t in tools]))
            continuing = request.continue_final_message
            text = render_chat_template(
                tok.chat_template, messages,
                add_generation_prompt=request.add_generation_prompt and not continuing,
                bos_token=tok.bos_token, eos_token=tok.eos_token,
                tools=tools if has_tools else None,
                **_template_kwargs(request.chat_template_kwargs_json))
            if continuing:
                text = _cut_after_final_message(text, request.messages)
            opened = self.reasoning and text.rfind(THINK_START) > text.rfind(THINK_END)
            thinks = opened or (self.reasoning and not text.rstrip().endswith(THINK_END))
            return Prompt(tok.encode(text), reasoning=self.reasoning, reasoning_open=opened,
                          constraint_after=THINK_END if thinks else "")
        return Prompt(tok.encode(request.prompt or "", add_special_tokens=True))


def _cut_after_final_message(text: str, messages: list[ChatMessage]) -> str:
    """The rendered conversation up to the end of its last message's content: what the
    template closes that turn with (an end-of-turn token) is cut, so the output goes on
    from the message's last word."""
    final = messages[-1]
    if final.role != "assistant" or not final.content:
        raise ValueError("continuing the final message needs a final assistant message "
                         "with text")
    end = text.rfind(final.content)
    if end < 0:  # the template changed the text (stripped it, say): nothing to cut at
        raise ValueError("this model's chat template does not show the final assistant "
                         "message as sent, so it cannot be continued")
    return text[:end + len(final.content)]


def _template_kwargs(text: str) -> dict:
    """`chat_template_kwargs` (a JSON object) as template variables; ValueError if it is not
    one or sets what llmbus gives the template itself."""
    if not text:
        return {}
    kwargs = json.loads(text)
    if not isinstance(kwargs, dict):
        raise ValueError("`chat_template_kwargs` must be an object")
    for name in RESERVED_TEMPLATE_VARIABLES:
        if name in kwargs:
            raise ValueError(f"`chat_template_kwargs` may not set `{name}`")
    return kwargs


def _as_dict(message: ChatMessage) -> dict:
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls_json:
        out["tool_calls"] = json.loads(message.tool_calls_json)
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _with_system_prompt(messages: list[dict], prompt: str) -> list[dict]:
    """`prompt` after the conversation's system message, or as one."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{prompt}"},
                *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]

"""The tokenizer's pure core, directly: no bus, no model file (a tiny byte-level vocabulary
stands in)."""

from __future__ import annotations

import pytest

from llmbus.bus.messages import (
    ChatMessage,
    EncodeRequest,
    GenerateRequest,
    SamplingParams,
)
from llmbus.services.tokenizer.tokenization import Tokenization
from tests.gguf_fixtures import tiny_tokenizer

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def _generate(**fields) -> GenerateRequest:
    return GenerateRequest(request_id="r", reply_subject="api", model="m",
                           params=SamplingParams(), **fields)


def test_tokenization_of_prompts_messages_and_ids():
    tokenization = Tokenization(tiny_tokenizer(chat_template=TEMPLATE))
    tok = tokenization.tokenizer
    assert tokenization.prompt_token_ids(_generate(prompt="hello")) == [0, *tok.encode("hello")]
    chat = tokenization.prompt_token_ids(_generate(
        messages=[ChatMessage(role="user", content="hello")]))
    assert tok.decode(chat) == "user: hello\nassistant: "
    assert chat.count(0) == 2  # the template's <s> are special tokens, not text
    assert tokenization.prompt_token_ids(_generate(prompt_token_ids=[5, 6])) == [5, 6]
    assert tokenization.prompt_token_ids(EncodeRequest(prompt="hello")) == \
        tokenization.prompt_token_ids(_generate(prompt="hello"))


def test_tokenization_refuses_what_the_model_cannot_take():
    tokenization = Tokenization(tiny_tokenizer())  # no chat template
    with pytest.raises(ValueError, match="no chat template"):
        tokenization.prompt_token_ids(_generate(messages=[ChatMessage(role="user",
                                                                      content="hi")]))
    with pytest.raises(ValueError, match="token id 262 is outside the vocabulary"):
        tokenization.prompt_token_ids(_generate(prompt_token_ids=[1, 262]))
    with pytest.raises(ValueError, match="logit_bias key -1"):
        tokenization.check_token_ids([-1], "logit_bias key")


THINKING = TEMPLATE.replace("<s>assistant: ", "<s>assistant: {% if opened %}<think>{% endif %}"
                            "{% if closed %}<think></think>{% endif %}")


@pytest.mark.parametrize(("parser", "template", "reasoning"), [
    ("auto", THINKING, True), ("auto", TEMPLATE, False), ("think", TEMPLATE, True),
    ("none", THINKING, False)])
def test_which_chats_have_their_reasoning_split(parser, template, reasoning):
    tokenization = Tokenization(tiny_tokenizer(chat_template=template), parser)
    chat = [ChatMessage(role="user", content="hi")]
    prompt = tokenization.prompt(_generate(messages=chat))
    assert (prompt.reasoning, prompt.reasoning_open) == (reasoning, False)
    # a structured output waits for the reasoning to end where the model may think first
    assert prompt.constraint_after == ("</think>" if reasoning else "")
    assert not tokenization.prompt(_generate(prompt="hi")).reasoning  # a completion: never
    if template is THINKING:  # the prompt opened the block: the output starts inside it
        opened = tokenization.prompt(_generate(
            messages=chat, chat_template_kwargs_json='{"opened": true}'))
        assert tokenization.tokenizer.decode(opened.token_ids).endswith("assistant: <think>")
        assert (opened.reasoning, opened.reasoning_open) == (reasoning, reasoning)
        closed = tokenization.prompt(_generate(
            messages=chat, chat_template_kwargs_json='{"closed": true}'))
        assert (closed.reasoning_open, closed.constraint_after) == (False, "")  # answers at once


def test_chat_template_kwargs_may_not_replace_what_llmbus_gives():
    tokenization = Tokenization(tiny_tokenizer(chat_template=TEMPLATE))
    for name in ("messages", "add_generation_prompt", "tools"):
        with pytest.raises(ValueError, match=f"may not set `{name}`"):
            tokenization.prompt(_generate(messages=[ChatMessage(role="user", content="hi")],
                                          chat_template_kwargs_json=f'{{"{name}": 1}}'))
    with pytest.raises(ValueError, match="reasoning parser 'r1'"):
        Tokenization(tiny_tokenizer(), "r1")

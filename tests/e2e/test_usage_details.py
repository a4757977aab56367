"""What the answers report beside the text: the prompt tokens the prefix cache held, in each
dialect's words, and chat's `refusal` fields (always null: the model refuses in words)."""

from __future__ import annotations

import httpx
import pytest

from tests.stack import AUTH, MODEL_NAME

BLOCK_SIZE = 16  # the shared stack's KV block: the prefix cache holds whole blocks
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


def _post(stack, path: str, body: dict) -> dict:
    response = httpx.post(f"{stack.base_url}{path}", json={"model": MODEL_NAME, **body},
                          headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _cached_twice(stack, path: str, body: dict, cached_of) -> tuple[int, int, dict]:
    """(cached tokens of a first and a second identical request, the second's usage)."""
    first, second = _post(stack, path, body), _post(stack, path, body)
    return cached_of(first["usage"]), cached_of(second["usage"]), second["usage"]


def _check(first: int, second: int, num_prompt_tokens: int) -> None:
    assert first < num_prompt_tokens  # nothing of this prompt was there at first...
    assert 0 < second < num_prompt_tokens + 1  # ...its whole blocks are the second time
    assert second % BLOCK_SIZE == 0 and second >= num_prompt_tokens - 2 * BLOCK_SIZE


def test_chat_and_completions_report_cached_tokens(stack):
    messages = [{"role": "system", "content": SYSTEM + "(chat)"},
                {"role": "user", "content": "Name a colour."}]
    first, second, usage = _cached_twice(
        stack, "/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0},
        lambda u: u["prompt_tokens_details"]["cached_tokens"])
    _check(first, second, usage["prompt_tokens"])
    first, second, usage = _cached_twice(
        stack, "/completions", {"prompt": SYSTEM + "(text)", "max_tokens": 3},
        lambda u: u["prompt_tokens_details"]["cached_tokens"])
    _check(first, second, usage["prompt_tokens"])


def test_responses_report_cached_tokens(stack):
    first, second, usage = _cached_twice(
        stack, "/responses", {"instructions": SYSTEM + "(responses)", "input": "Hi",
                              "max_output_tokens": 3, "store": False},
        lambda u: u["input_tokens_details"]["cached_tokens"])
    _check(first, second, usage["input_tokens"])
    assert usage["input_tokens_details"]["cache_write_tokens"] == 0


def test_messages_report_cache_reads_apart_from_input_tokens(stack):
    body = {"system": SYSTEM + "(messages)", "max_tokens": 3,
            "messages": [{"role": "user", "content": "Hi"}]}
    first, second, usage = _cached_twice(stack, "/messages", body,
                                         lambda u: u["cache_read_input_tokens"])
    counted = _post(stack, "/messages/count_tokens", body)["input_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted
    assert usage["cache_creation_input_tokens"] == 0
    _check(first, second, counted)


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_messages_carry_a_null_refusal(stack, logprobs):
    reply = _post(stack, "/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": logprobs})
    choice = reply["choices"][0]
    assert "refusal" in choice["message"] and choice["message"]["refusal"] is None
    if logprobs:
        assert choice["logprobs"]["refusal"] is None and len(choice["logprobs"]["content"]) == 2

"""Bad input gets a 400 with an OpenAI-style error body, never a stack trace or a hang."""

from __future__ import annotations

import httpx
import pytest

from tests.stack import AUTH, MODEL_NAME

pytestmark = pytest.mark.model

CHAT = "/chat/completions"
COMPLETIONS = "/completions"
HELLO = [{"role": "user", "content": "hello"}]

CASES = [
    ("malformed json", CHAT, b'{"model": ', None),
    ("empty body", CHAT, b"", None),
    ("body not an object", CHAT, b"[1, 2]", None),
    ("missing messages", CHAT, {"model": MODEL_NAME}, "messages"),
    ("empty messages", CHAT, {"model": MODEL_NAME, "messages": []}, "messages"),
    ("unknown role", CHAT, {"model": MODEL_NAME, "messages": [{"role": "x", "content": "a"}]},
     "messages"),
    ("max_tokens zero", CHAT, {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 0},
     "max_tokens"),
    ("max_tokens negative", COMPLETIONS,
     {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("wrong type", CHAT, {"model": MODEL_NAME, "messages": HELLO, "temperature": "hot"},
     "temperature"),
    ("temperature out of range", CHAT,
     {"model": MODEL_NAME, "messages": HELLO, "temperature": 7}, "temperature"),
    ("missing prompt", COMPLETIONS, {"model": MODEL_NAME}, "prompt"),
    ("empty prompt", COMPLETIONS, {"model": MODEL_NAME, "prompt": ""}, "prompt"),
    ("prompt too long", COMPLETIONS, {"model": MODEL_NAME, "prompt": "hello " * 9000},
     "prompt"),
    ("chat too long", CHAT,
     {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello " * 9000}]},
     "messages"),
    ("prompt + max_tokens beyond context", COMPLETIONS,
     {"model": MODEL_NAME, "prompt": "hello " * 8000, "max_tokens": 1000}, "max_tokens"),
    ("token id outside vocabulary", COMPLETIONS, {"model": MODEL_NAME, "prompt": [1, 10**9]},
     "prompt"),
    ("more prompts than the cap", COMPLETIONS,
     {"model": MODEL_NAME, "prompt": ["hi"] * 65, "max_tokens": 1}, "prompt"),
    ("negative temperature", CHAT,
     {"model": MODEL_NAME, "messages": HELLO, "temperature": -0.5}, "temperature"),
    ("top_p above one", CHAT, {"model": MODEL_NAME, "messages": HELLO, "top_p": 1.5}, "top_p"),
    ("n beyond the cap", CHAT, {"model": MODEL_NAME, "messages": HELLO, "n": 100}, "n"),
    ("n as a string", CHAT, {"model": MODEL_NAME, "messages": HELLO, "n": "two"}, "n"),
    ("stop as a number", CHAT, {"model": MODEL_NAME, "messages": HELLO, "stop": 5}, "stop"),
    ("top_logprobs beyond 20", CHAT, {"model": MODEL_NAME, "messages": HELLO, "logprobs": True,
                                      "top_logprobs": 50}, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT,
     {"model": MODEL_NAME, "messages": HELLO, "top_logprobs": 2}, "top_logprobs"),
    ("logit_bias key not a token id", CHAT,
     {"model": MODEL_NAME, "messages": HELLO, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias token outside vocabulary", CHAT,
     {"model": MODEL_NAME, "messages": HELLO, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("stream_options without stream", CHAT, {"model": MODEL_NAME, "messages": HELLO,
                                             "stream_options": {"include_usage": True}},
     "stream_options"),
    ("unsupported parameter", CHAT,
     {"model": MODEL_NAME, "messages": HELLO, "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize(("name", "path", "body", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_400_with_openai_error(stack, name, path, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{stack.base_url}{path}", timeout=30,
                          headers={"content-type": "application/json", **AUTH}, **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_unknown_model_is_a_404_model_not_found(stack, path):
    body = {"model": "gpt-9", "messages": HELLO} if path == CHAT else {"model": "gpt-9",
                                                                         "prompt": "hi"}
    response = httpx.post(f"{stack.base_url}{path}", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_unknown_route_is_a_404_with_openai_error(stack):
    response = httpx.get(f"{stack.base_url}/nope", headers=AUTH, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_models_lists_the_served_model(stack):
    data = httpx.get(f"{stack.base_url}/models", headers=AUTH, timeout=10).json()["data"]
    assert [m["id"] for m in data] == [MODEL_NAME]
    assert data[0]["max_model_len"] == 8192


def test_health_reports_every_stage_ready(stack):
    response = httpx.get(stack.base_url.removesuffix("/v1") + "/health", timeout=10)
    assert response.status_code == 200
    assert response.json()["stages"] == {"tokenizer": True, "scheduler": True,
                                         "executor": True, "detokenizer": True}

"""`/v1/embeddings` and `/v1/score` through the whole stack with the official openai SDK: the
default model's mean-pooled, normalised last hidden state as transformers computes it (the
shared stack runs the exact mode), float and base64, a batch of 64, `dimensions`, token-id
inputs, and each bad input's 400."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.stack import API_KEY, AUTH, MODEL_NAME

pytestmark = pytest.mark.model

TEXTS = ["The capital of France is Paris.", "A recipe for bread needs flour and water.",
         "Paris is the capital city of France."]
COSINE_DISTANCE = 1e-5  # float32 both sides, sums in other orders (see test_embedding_model.py)


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def _reference(hf_reference, text: str) -> np.ndarray:
    tokenizer, model = hf_reference
    with torch.inference_mode():
        hidden = model.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0]
    vector = hidden.mean(0).numpy().astype(np.float64)
    return vector / np.linalg.norm(vector)


def test_embeddings_equal_transformers_mean_pooled(stack, hf_reference):
    reply = _client(stack).embeddings.create(model=MODEL_NAME, input=TEXTS,
                                             encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == MODEL_NAME
    for text, item in zip(TEXTS, reply.data, strict=True):
        ours = np.asarray(item.embedding, dtype=np.float64)
        assert abs(np.linalg.norm(ours) - 1.0) < 1e-6  # unit vectors by default
        assert 1.0 - float(ours @ _reference(hf_reference, text)) <= COSINE_DISTANCE
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0


def test_base64_token_ids_dimensions_and_a_batch_of_64(stack):
    client = _client(stack)
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    packed = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])  # the SDK asks base64
    assert packed.data[0].embedding == floats.data[0].embedding  # float32 either way
    tokens = httpx.post(stack.base_url.removesuffix("/v1") + "/tokenize", headers=AUTH,
                        json={"prompt": TEXTS[0]}, timeout=30).json()["tokens"]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[tokens], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-6)
    short = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=64,
                                     encoding_format="float").data[0].embedding
    full = np.asarray(floats.data[0].embedding)
    assert len(short) == 64
    assert np.allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)
    batch = [f"Sentence number {i} is about the number {i * 7}." for i in range(64)]
    many = client.embeddings.create(model=MODEL_NAME, input=batch, encoding_format="float")
    assert [d.index for d in many.data] == list(range(64))
    vectors = np.asarray([d.embedding for d in many.data])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert len({tuple(np.round(v, 4)) for v in vectors}) == 64  # each input its own


def test_score_is_the_cosine_of_the_embeddings(stack):
    client = _client(stack)
    vectors = [np.asarray(d.embedding) for d in client.embeddings.create(
        model=MODEL_NAME, input=TEXTS, encoding_format="float").data]
    reply = httpx.post(f"{stack.base_url}/score", headers=AUTH, timeout=60, json={
        "model": MODEL_NAME, "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    scores = [d["score"] for d in reply["data"]]
    assert np.allclose(scores, [vectors[0] @ vectors[1], vectors[0] @ vectors[2]], atol=1e-5)
    assert scores[1] > scores[0]  # the same fact in other words is closer than bread


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
    ({"input": "x" * 40000}, "input"),  # longer than the context window
    ({"input": "hi", "dimensions": 100000}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "pooling": "max"}, "pooling")])  # not a parameter of this API
def test_bad_input_is_a_400(stack, body, param):
    reply = httpx.post(f"{stack.base_url}/embeddings", headers=AUTH, timeout=60,
                       json={"model": MODEL_NAME, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


async def test_a_call_of_1000_inputs_is_served_beside_other_clients(stack):
    """LangChain's default batch is 1,000 inputs; the scheduler queues 256 requests. The api
    feeds them in pieces, so the call is served on an idle server and a chat sent meanwhile is
    answered too (neither gets a 503)."""
    import asyncio

    inputs = [f"item {i}: a short sentence to embed." for i in range(1000)]
    async with httpx.AsyncClient(timeout=300, headers=AUTH) as http:
        embedding = asyncio.create_task(http.post(f"{stack.base_url}/embeddings", json={
            "model": MODEL_NAME, "input": inputs}))
        await asyncio.sleep(0.5)
        chat = await http.post(f"{stack.base_url}/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0})
        reply = await embedding
    assert chat.status_code == 200, chat.text
    assert reply.status_code == 200, reply.text
    assert [d["index"] for d in reply.json()["data"]] == list(range(1000))

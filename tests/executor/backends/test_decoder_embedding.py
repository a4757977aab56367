"""A decoder embedder (Qwen3-Embedding's shape): a tiny `qwen3` GGUF with llama.cpp's
`qwen3.pooling_type = 3` ("last") serves embedding requests through ModelRunner, in the exact
mode of each CPU backend, as transformers' Qwen3 pools its last hidden state.

Tolerance: float32 on both sides, the same GGUF values, two layers of sums of at most 512
products taken in other orders: components differ by a few float32 epsilons (1.2e-7; measured:
2.6e-7 of the largest), a cosine distance below 1e-13; the issue's bound, 1e-5, holds with
room, and a wrong pooling (the mean of the same rows) lands far above it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from llmbus.services.executor.runner import ModelRunner
from tests.executor.embedding_driver import cosine_distance, embed
from tests.gguf_fixtures import QWEN3_SPEC, write_tiny_llama
from tests.hf_reference import hf_from_gguf

pytest.importorskip("transformers")

COSINE_DISTANCE = 1e-5
SPEC = replace(QWEN3_SPEC, pooling_type=3)  # llama.cpp's LLAMA_POOLING_TYPE_LAST
PROMPT = [int(t) for t in np.random.default_rng(4).integers(3, SPEC.vocab_size, 40)]


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory):
    """The file, and transformers' final hidden states of PROMPT ([T, D], after the norm)."""
    path = tmp_path_factory.mktemp("qwen3emb") / "tiny-qwen3-embedding.gguf"
    write_tiny_llama(path, SPEC, seed=6, arch="qwen3")
    model = hf_from_gguf(path, "Qwen3")
    with torch.inference_mode():
        hidden = model.model(torch.tensor([PROMPT])).last_hidden_state[0]
    return path, hidden.numpy()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_last_token_pooling_equals_transformers(qwen3_embedder, backend):
    path, hidden = qwen3_embedder
    runner = ModelRunner(path, model_name="qwen3-embedding", num_blocks=32, backend=backend,
                         exact=True)
    assert runner.pooling == "last"  # from the file's qwen3.pooling_type
    ours = embed(runner, PROMPT, "model")  # in 6 chunks, beside a generating request
    assert cosine_distance(ours, hidden[-1]) <= COSINE_DISTANCE
    np.testing.assert_allclose(np.linalg.norm(ours), np.linalg.norm(hidden[-1]), rtol=1e-5)
    # So the comparison can fail: the mean of the same rows is another vector.
    assert cosine_distance(ours, hidden.mean(0)) > 1e3 * COSINE_DISTANCE

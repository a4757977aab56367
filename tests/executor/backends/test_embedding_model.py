"""Embedding requests through ModelRunner on the default model: their prompts in chunks beside
a generating request, pooled as transformers' last hidden state pools (exact mode, every
pooling), and the fast mode within what its rounding allows of the exact mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.model_files import default_model_path
from tests.executor.embedding_driver import cosine_distance, embed
from tests.executor.rounding_noise import NUM_DRAWS, Z_RMS, draws, fast_mode_model, rms

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not default_model_path().is_file(), reason="default model not pulled"),
]

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."
# Exact mode: float32 on both sides, the same GGUF values, sums of ~576 products per matmul
# through 30 layers, summed in other orders: relative differences of a few 1e-6 per component
# (float32's epsilon 1.2e-7 times the growth of 30 layers' rounding); the bound,
# 1e-5 cosine distance, holds with room.
COSINE_DISTANCE = 1e-5


def _hf_pooled(hf_reference, prompt: list[int], pooling: str) -> np.ndarray:
    _, model = hf_reference
    with torch.inference_mode():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]  # after the norm
    return {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling].numpy()


@pytest.fixture(scope="module")
def prompt(hf_reference) -> list[int]:
    tokenizer, _ = hf_reference
    return tokenizer(TEXT)["input_ids"]


@pytest.fixture(scope="module", params=["onnxruntime", "torch"])
def exact_runner(request) -> ModelRunner:
    return ModelRunner(default_model_path(), model_name="default", num_blocks=32,
                       max_model_len=256, backend=request.param, exact=True)


def test_exact_embeddings_pool_as_transformers_does(hf_reference, prompt, exact_runner):
    runner = exact_runner
    assert runner.pooling == "mean"  # a generation model without a pooling_type
    for pooling in ("mean", "cls", "last"):
        ours = embed(runner, prompt, pooling)
        theirs = _hf_pooled(hf_reference, prompt, pooling)
        assert cosine_distance(ours, theirs) <= COSINE_DISTANCE, pooling
        np.testing.assert_allclose(np.linalg.norm(ours), np.linalg.norm(theirs), rtol=1e-5)
    assert np.array_equal(embed(runner, prompt, "model"), embed(runner, prompt, "mean"))


def test_fast_mode_embedding_is_within_its_rounding_of_exact(prompt):
    """The fast mode's pooled vector is as far from the exact mode's as its rounding takes it:
    NUM_DRAWS equally valid roundings of the exact forward (rounding_noise.py) give the
    deviation's spread; the fast mode's must be within Z_RMS of their standard deviations."""
    exact_runner = ModelRunner(default_model_path(), model_name="default", num_blocks=32,
                               max_model_len=256, backend="torch", exact=True)  # loads fast
    exact = torch.from_numpy(embed(exact_runner, prompt, "mean").copy())[None]
    fast = ModelRunner(default_model_path(), model_name="default", num_blocks=32,
                       max_model_len=256)
    ours = torch.from_numpy(embed(fast, prompt, "mean").copy())[None]
    model, noise = fast_mode_model(default_model_path(),
                                   graphs=fast.choice.backend == "onnxruntime")
    table = list(range(1, 1 + -(-len(prompt) // 4)))

    def pooled(m) -> torch.Tensor:  # [1, D]: the mean of the prompt's normed hidden states
        meta = build_attention_metadata([len(prompt)], [len(prompt)], [table], 4)
        with torch.inference_mode():
            m.forward(torch.tensor(prompt), meta.positions, meta,
                      KVCache(m.config, 32, 4, torch.float32), torch.arange(0))
            return m.last_hidden(torch.arange(len(prompt))).mean(0)[None]

    unrounded = pooled(model)
    spread = rms(draws(model, pooled, noise) - unrounded)  # [NUM_DRAWS]
    assert len(spread) == NUM_DRAWS
    assert rms(ours - exact) <= spread.mean() + Z_RMS * spread.std(), (
        float(rms(ours - exact)), spread.tolist())

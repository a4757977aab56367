"""Embedding requests through ModelRunner on the default model: their prompts in chunks beside
a generating request, pooled as transformers' last hidden state pools (exact mode, every
pooling), and the fast mode within what its rounding allows of the exact mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.model_files import default_model_path
from tests.executor.rounding_noise import NUM_DRAWS, Z_RMS, draws, fast_mode_model, rms

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not default_model_path().is_file(), reason="default model not pulled"),
]

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."
CHUNK = 7  # the embedding prompt goes in chunks of this many tokens
# Exact mode: float32 on both sides, the same GGUF values, sums of ~576 products per matmul
# through 30 layers, summed in other orders: relative differences of a few 1e-6 per component
# (float32's epsilon 1.2e-7 times the growth of 30 layers' rounding); the bound,
# 1e-5 cosine distance, holds with room.
COSINE_DISTANCE = 1e-5


def _embed(runner: ModelRunner, prompt: list[int], pooling: str) -> np.ndarray:
    """One embedding request in chunks of CHUNK, each step beside a generating request's
    decode or prefill; the vector its last chunk returns."""
    other = [1, 2, 3, 4, 5]
    new = [NewRequestData("emb", prompt, SamplingParams(max_tokens=0, pooling=pooling)),
           NewRequestData("gen", other, SamplingParams(temperature=0.0, max_tokens=8))]
    blocks, block_size = iter(range(1, runner.kv_cache.num_blocks)), runner.block_size
    tables = {"emb": 0, "gen": 0}

    def take(sequence_id: str, end: int) -> list[int]:
        count = -(-end // block_size) - tables[sequence_id]
        tables[sequence_id] += count
        return [next(blocks) for _ in range(count)]

    vectors, start, gen_len, step = [], 0, len(other), 0
    while start < len(prompt):
        end = min(start + CHUNK, len(prompt))
        gen_start = 0 if step == 0 else gen_len - 1
        gen = ScheduledRequest("gen", gen_start, gen_len - gen_start, take("gen", gen_len))
        emb = ScheduledRequest("emb", start, end - start, take("emb", end), sample=False)
        result = runner.step(StepPlan(step, new, [emb, gen]))
        assert result.error == "", result.error
        assert len(result.sampled_token_ids) == 1  # the decode samples; the embedding not
        gen_len, new, start, step = gen_len + 1, [], end, step + 1
        vectors += result.embeddings
    runner.step(StepPlan(step, finished_sequence_ids=["emb", "gen"]))
    [vector] = vectors
    assert vector.sequence_id == "emb"
    return np.frombuffer(vector.vector, dtype="<f4")


def _hf_pooled(hf_reference, prompt: list[int], pooling: str) -> np.ndarray:
    _, model = hf_reference
    with torch.inference_mode():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]  # after the norm
    return {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling].numpy()


def _cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return 1.0 - float(a64 @ b64 / np.linalg.norm(a64) / np.linalg.norm(b64))


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
        ours = _embed(runner, prompt, pooling)
        theirs = _hf_pooled(hf_reference, prompt, pooling)
        assert _cosine_distance(ours, theirs) <= COSINE_DISTANCE, pooling
        np.testing.assert_allclose(np.linalg.norm(ours), np.linalg.norm(theirs), rtol=1e-5)
    assert np.array_equal(_embed(runner, prompt, "model"), _embed(runner, prompt, "mean"))


def test_fast_mode_embedding_is_within_its_rounding_of_exact(prompt):
    """The fast mode's pooled vector is as far from the exact mode's as its rounding takes it:
    NUM_DRAWS equally valid roundings of the exact forward (rounding_noise.py) give the
    deviation's spread; the fast mode's must be within Z_RMS of their standard deviations."""
    exact_runner = ModelRunner(default_model_path(), model_name="default", num_blocks=32,
                               max_model_len=256, backend="torch", exact=True)  # loads fast
    exact = torch.from_numpy(_embed(exact_runner, prompt, "mean").copy())[None]
    fast = ModelRunner(default_model_path(), model_name="default", num_blocks=32,
                       max_model_len=256)
    ours = torch.from_numpy(_embed(fast, prompt, "mean").copy())[None]
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

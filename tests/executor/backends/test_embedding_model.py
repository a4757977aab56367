"""Embedding requests through ModelRunner: their prompts in chunks beside a generating request,
pooled as the float64 reference pools its final hidden states (exact mode, every pooling, on
ONNX Runtime's graphs and on torch), and the fast mode within what its rounding allows of the
exact mode. A tiny generated llama keeps it fast; the default model's mean pooling is held to
transformers through the whole stack (tests/e2e/test_embeddings_api.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.runner import ModelRunner
from tests.executor.reference_forward import reference_hidden
from tests.executor.rounding_noise import NUM_DRAWS, Z_RMS, draws, fast_mode_model, rms
from tests.gguf_fixtures import TinySpec, write_tiny_llama

SPEC = TinySpec()
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(23)]
CHUNK = 7  # the embedding prompt goes in chunks of this many tokens
# Exact mode: float32 sums of at most 128 products through 2 layers, against float64: relative
# errors of ~1e-6 per component (float32's epsilon 1.2e-7 times the sums' growth); the
# issue's bound, 1e-5 cosine distance, holds with room.
COSINE_DISTANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed") / "tiny-q8.gguf"
    return path, write_tiny_llama(path, SPEC, quantized="Q8_0")


def _embed(runner: ModelRunner, prompt: list[int], pooling: str) -> np.ndarray:
    """One embedding request in chunks of CHUNK, each step beside a generating request's
    prefill or decode; the vector its last chunk returns."""
    other = [1, 2, 3, 4, 5]
    new = [NewRequestData("emb", prompt, SamplingParams(max_tokens=1, pooling=pooling)),
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


def _cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return 1.0 - float(a64 @ b64 / np.linalg.norm(a64) / np.linalg.norm(b64))


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_exact_embeddings_pool_as_the_reference_does(tiny, backend):
    path, weights = tiny
    runner = ModelRunner(path, model_name="tiny", num_blocks=32, block_size=4,
                         max_model_len=128, backend=backend, exact=True)
    assert runner.pooling == "mean"  # a generation model without a pooling_type
    hidden = reference_hidden(weights, SPEC, PROMPT).numpy()
    for pooling, expected in (("mean", hidden.mean(0)), ("cls", hidden[0]),
                              ("last", hidden[-1])):
        ours = _embed(runner, PROMPT, pooling)
        assert _cosine_distance(ours, expected) <= COSINE_DISTANCE, pooling
        np.testing.assert_allclose(np.linalg.norm(ours), np.linalg.norm(expected), rtol=1e-5)
    assert np.array_equal(_embed(runner, PROMPT, "model"), _embed(runner, PROMPT, "mean"))


def test_fast_mode_embedding_is_within_its_rounding_of_exact(tiny):
    """The fast mode's pooled vector is as far from the exact mode's as its rounding takes it:
    NUM_DRAWS equally valid roundings of the exact forward (rounding_noise.py) give the
    deviation's spread; the fast mode's must be within Z_RMS of their standard deviations."""
    path, _ = tiny
    exact_runner = ModelRunner(path, model_name="tiny", num_blocks=32, block_size=4,
                               max_model_len=128, backend="torch", exact=True)
    exact = torch.from_numpy(_embed(exact_runner, PROMPT, "mean").copy())[None]
    fast = ModelRunner(path, model_name="tiny", num_blocks=32, block_size=4, max_model_len=128,
                       backend="auto")  # the fast mode: the integer kernel where it builds
    ours = torch.from_numpy(_embed(fast, PROMPT, "mean").copy())[None]
    model, noise = fast_mode_model(path, graphs=fast.choice.backend == "onnxruntime")
    table = list(range(1, 1 + -(-len(PROMPT) // 4)))

    def pooled(m) -> torch.Tensor:  # [1, D]: the mean of the prompt's normed hidden states
        meta = build_attention_metadata([len(PROMPT)], [len(PROMPT)], [table], 4)
        with torch.inference_mode():
            m.forward(torch.tensor(PROMPT), meta.positions, meta,
                      KVCache(m.config, 32, 4, torch.float32), torch.arange(0))
            return m.last_hidden(torch.arange(len(PROMPT))).mean(0)[None]

    unrounded = pooled(model)
    spread = rms(draws(model, pooled, noise) - unrounded)  # [NUM_DRAWS]
    assert len(spread) == NUM_DRAWS
    assert rms(ours - exact) <= spread.mean() + Z_RMS * spread.std(), (
        float(rms(ours - exact)), spread.tolist())
    assert rms(ours - exact) > 0  # the fast mode does round: the bound is not vacuous here

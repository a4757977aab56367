"""Embedding requests driven through `ModelRunner.step` as the scheduler drives them: the prompt
in chunks, each step beside a generating request, never sampled; shared by the embedding
tests of the default model and of the tiny families."""

from __future__ import annotations

import numpy as np

from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from llmbus.services.executor.runner import ModelRunner

CHUNK = 7  # the embedding prompt goes in chunks of this many tokens


def embed(runner: ModelRunner, prompt: list[int], pooling: str,
          chunk: int = CHUNK) -> np.ndarray:
    """One embedding request (SamplingParams as the api sends it) in chunks of `chunk`, each
    step beside a generating request's decode or prefill; the vector its last chunk returns."""
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
        end = min(start + chunk, len(prompt))
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


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    """1 - cos(a, b), in float64."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return 1.0 - float(a64 @ b64 / np.linalg.norm(a64) / np.linalg.norm(b64))

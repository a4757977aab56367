"""The executor's pure core on a tiny random llama: loader, paged forward, runner, sampler."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.sampling.sampler import sample
from llmbus.services.executor.sampling.sampling_tensors import SamplingTensors
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.model_config import UnsupportedModelError
from tests.executor.reference_forward import paged_forward, reference_logits
from tests.gguf_fixtures import GREEDY, TinySpec, generate, write_tiny_llama

SPEC = TinySpec()
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return path, write_tiny_llama(path, SPEC)


@pytest.fixture(scope="module")
def runner(tiny):
    return ModelRunner(tiny[0], model_name="tiny", block_size=BLOCK_SIZE, num_blocks=256)


@pytest.mark.parametrize("tied", [True, False])
def test_loader_round_trip(tmp_path, tied):
    spec = TinySpec(tied=tied)
    weights = write_tiny_llama(tmp_path / "m.gguf", spec, seed=3)
    config, loaded, _ = load_gguf(tmp_path / "m.gguf")
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.context_length) == (256, 512)
    assert config.rope_theta == 10000.0 and config.rms_norm_eps == pytest.approx(1e-5)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.tie_word_embeddings is tied
    for name, array in weights.items():  # un-permuted Q/K equal what was generated
        assert torch.equal(loaded[name], torch.from_numpy(array)), name
    assert torch.equal(loaded["output.weight"],
                       torch.from_numpy(weights["output.weight" if not tied
                                                else "token_embd.weight"]))


def test_loader_rejects_other_architectures(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load_gguf(tmp_path / "f.gguf")


def test_paged_batched_forward_matches_reference(tiny):
    path, weights = tiny
    config, loaded, _ = load_gguf(path)
    model = LlamaModel(config, loaded, max_positions=128)
    cache = KVCache(config, num_blocks=64, block_size=BLOCK_SIZE)
    rng = random.Random(0)
    lengths = [1, 4, 7, 13, 22, 31]  # several not multiples of the block size
    prompts = [[rng.randrange(SPEC.vocab_size) for _ in range(n)] for n in lengths]
    free = list(range(1, 64))
    rng.shuffle(free)  # non-contiguous, shuffled block ids
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]
    references = [reference_logits(weights, SPEC, p).float() for p in prompts]

    # Step 1: every sequence computes a prefix; step 2: the rest (chunks and single tokens),
    # so step 2 attends over KV written by step 1 in the same paged cache.
    splits = [0, 3, 6, 5, 21, 16]
    first = [(p, 0, s, t) for p, s, t in zip(prompts, splits, tables, strict=True) if s > 0]
    logits = paged_forward(model, cache, first)
    expected = torch.cat([r[:s] for r, s in zip(references, splits, strict=True) if s > 0])
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)

    second = [(p, s, len(p), t) for p, s, t in zip(prompts, splits, tables, strict=True)
              if s < len(p)]
    logits = paged_forward(model, cache, second)
    expected = torch.cat([r[s:] for r, s in zip(references, splits, strict=True)
                          if s < len(r)])
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-4)


def _prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, SPEC.vocab_size) for _ in range(n)] for n in lengths]


def test_chunked_prefill_and_decode_match_one_shot(runner):
    prompts = _prompts([5, 9, 16, 23])
    one_shot = generate(runner, prompts, max_tokens=10)
    chunked = generate(runner, prompts, max_tokens=10, chunk_size=3, shuffle_blocks=7)
    alone = [generate(runner, [p], max_tokens=10, chunk_size=4)[0] for p in prompts]
    assert chunked == one_shot
    assert alone == one_shot
    assert all(len(out) == 10 for out in one_shot)
    assert runner.requests == {}


def test_seeded_sampling_ignores_the_rest_of_the_batch(runner):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    prompt, others = _prompts([11])[0], _prompts([4, 17, 8], seed=2)
    alone = generate(runner, [prompt], max_tokens=12, params=[seeded])[0]
    batch_params = [SamplingParams(temperature=0.7), seeded, SamplingParams(temperature=1.0,
                    seed=99, top_k=20), SamplingParams(temperature=1.0)]
    batched = generate(runner, [others[0], prompt, others[1], others[2]], max_tokens=12,
                       params=batch_params, chunk_size=5, shuffle_blocks=3)
    assert batched[1] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert generate(runner, [prompt], max_tokens=12, params=[other_seed])[0] != alone


def test_top_k_1_equals_greedy(runner):
    prompts = _prompts([6, 13])
    greedy = generate(runner, prompts, max_tokens=8)
    top1 = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=0.8, top_k=1)]
    assert generate(runner, prompts, max_tokens=8, params=top1) == greedy


def test_preempted_request_recomputes_and_continues(runner):
    prompt = _prompts([10])[0]
    expected = generate(runner, [prompt], max_tokens=6)[0]
    new = NewRequestData(sequence_id="p", prompt_token_ids=prompt, params=GREEDY)
    first = runner.step(StepPlan(step_id=0, new_requests=[new], scheduled=[ScheduledRequest(
        sequence_id="p", start=0, num_tokens=10, new_block_ids=[1, 2, 3])]))
    second = runner.step(StepPlan(step_id=1, scheduled=[ScheduledRequest(
        sequence_id="p", start=10, num_tokens=1)]))
    # Blocks taken back; recompute all 12 known tokens into other blocks, then sample.
    third = runner.step(StepPlan(step_id=2, preempted_sequence_ids=["p"]))
    fourth = runner.step(StepPlan(step_id=3, scheduled=[ScheduledRequest(
        sequence_id="p", start=0, num_tokens=12, new_block_ids=[9, 5, 7])]))
    runner.step(StepPlan(step_id=4, finished_sequence_ids=["p"]))
    assert not (first.error or second.error or third.error or fourth.error)
    tokens = first.sampled_token_ids + second.sampled_token_ids + fourth.sampled_token_ids
    assert tokens == expected[:3]
    assert (fourth.batch_size, fourth.num_tokens) == (1, 12) and fourth.forward_seconds > 0


def test_step_errors_are_reported_not_raised(runner):
    result = runner.step(StepPlan(step_id=5, scheduled=[ScheduledRequest(
        sequence_id="nobody", start=0, num_tokens=1)]))
    assert result.step_id == 5 and "nobody" in result.error
    new = NewRequestData(sequence_id="short", prompt_token_ids=[5] * 9, params=GREEDY)
    result = runner.step(StepPlan(step_id=6, new_requests=[new], scheduled=[ScheduledRequest(
        sequence_id="short", start=0, num_tokens=9, new_block_ids=[1])]))
    assert "blocks cannot hold" in result.error
    runner.step(StepPlan(step_id=7, finished_sequence_ids=["short"]))
    assert generate(runner, _prompts([3]), max_tokens=2)[0]  # still serves


def test_info_and_cache_geometry(runner):
    info = runner.info()
    assert (info.model_name, info.num_blocks, info.block_size) == ("tiny", 256, BLOCK_SIZE)
    assert (info.eos_token_ids, info.vocab_size, info.max_model_len) == ([2], 256, 512)
    per_block = bytes_per_block(runner.config, BLOCK_SIZE, torch.float32)
    assert per_block == 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE
    assert num_blocks_for_budget(runner.config, BLOCK_SIZE, torch.float32, 10 * per_block) == 10
    assert num_blocks_for_budget(runner.config, BLOCK_SIZE, torch.float32, 0) == 2


def test_sampler_filters():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]] * 6)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0,
              top_p=0.5), SamplingParams(temperature=0.0), SamplingParams(temperature=5.0),
              SamplingParams(temperature=1.0, top_p=0.0), SamplingParams(temperature=1.0,
              top_p=0.8, top_k=3)]
    tensors = SamplingTensors.from_params(params)
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, tensors, [None] * 6, generator) for _ in range(300)])
    assert set(draws[:, 0].tolist()) == {1, 2}  # top_k=2
    assert set(draws[:, 1].tolist()) == {1}  # p(1) = 0.64 reaches top_p alone
    assert set(draws[:, 2].tolist()) == {1}  # greedy
    assert set(draws[:, 3].tolist()) == {0, 1, 2, 3, 4}  # hot: everything appears
    assert set(draws[:, 4].tolist()) == {1}  # top_p=0: the most likely token only
    assert set(draws[:, 5].tolist()) == {1, 2}  # top_k=3 then top_p: 0.67 + 0.24 > 0.8


def test_small_steps_run_on_fewer_threads(tiny, monkeypatch):
    """Steps of at most SMALL_STEP_TOKENS tokens take small_step_threads, bigger ones all."""
    from llmbus.services.executor import runner as runner_module
    from llmbus.services.executor.options import default_small_step_threads

    before = torch.get_num_threads()
    try:
        runner = ModelRunner(tiny[0], model_name="tiny", block_size=BLOCK_SIZE, num_blocks=64,
                             num_threads=2, small_step_threads=1)
        small = runner_module.SMALL_STEP_TOKENS
        plan = StepPlan(step_id=0, new_requests=[
            NewRequestData(sequence_id="a", prompt_token_ids=list(range(3, 3 + small + 1)),
                           params=GREEDY)],
            scheduled=[ScheduledRequest(sequence_id="a", start=0, num_tokens=small + 1,
                                        new_block_ids=[1, 2, 3])])
        assert runner.step(plan).error == ""
        assert torch.get_num_threads() == 2  # a big step: every thread
        decode = StepPlan(step_id=1, scheduled=[
            ScheduledRequest(sequence_id="a", start=small + 1, num_tokens=1)])
        assert runner.step(decode).error == ""
        assert torch.get_num_threads() == 1  # a single decode: one core left to the stack
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert default_small_step_threads(2) == 1
    assert default_small_step_threads(1) == 1
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_small_step_threads(16) == 16

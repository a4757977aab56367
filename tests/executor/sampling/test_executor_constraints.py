"""Constrained requests in the executor's batch, on a tiny random model: the output follows the
grammar, unconstrained neighbours are untouched, preemption and recompute keep the matcher
where its tokens are, and logprobs stay the model's raw ones."""

from __future__ import annotations

import re

import pytest

from llmbus.bus.messages import (
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StructuredOutput,
)
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.sampling.constraints import Grammars, Vocabulary
from tests.gguf_fixtures import GREEDY, TinySpec, generate, write_tiny_llama

SPEC = TinySpec()
EOS = SPEC.eos_token_id
PRINTABLE = range(32, 127)  # token i is the byte i here; the rest are special
LETTERS = StructuredOutput(kind="regex", spec="[a-z]{3,6}", param="guided_regex")


def tiny_vocabulary() -> Vocabulary:
    tokens = [bytes([i]) if i in PRINTABLE else b"" for i in range(SPEC.vocab_size)]
    special = [i for i in range(SPEC.vocab_size) if i not in PRINTABLE]
    return Vocabulary(tokens, special, [EOS], lambda text: list(text.encode()))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, SPEC)
    runner = ModelRunner(path, model_name="tiny", block_size=4, num_blocks=128)
    runner.grammars = Grammars(tiny_vocabulary, SPEC.vocab_size)
    return runner


def text_of(tokens: list[int]) -> str:
    assert tokens[-1] == EOS, tokens
    return bytes(tokens[:-1]).decode()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_output_follows_the_grammar_and_neighbours_are_untouched(runner, temperature):
    prompts = [[1, 40, 50, 60], [1, 70, 80]]
    constrained = SamplingParams(temperature=temperature, seed=3, structured=LETTERS)
    out = generate(runner, prompts, max_tokens=10, params=[constrained, GREEDY],
                   stop_token_ids=(EOS,))
    assert re.fullmatch("[a-z]{3,6}", text_of(out[0]))
    alone = generate(runner, prompts[1:], max_tokens=10, stop_token_ids=(EOS,))
    assert out[1] == alone[0]
    unconstrained = generate(runner, prompts[:1], max_tokens=10, stop_token_ids=(EOS,))
    assert unconstrained[0] != out[0]  # the random model alone writes no such thing


def test_logprobs_are_the_raw_model_distribution(runner):
    plain = SamplingParams(temperature=0.0, logprobs=3)
    masked = SamplingParams(temperature=0.0, logprobs=3, structured=StructuredOutput(
        kind="choice", spec='["zz"]'))
    results = []
    for i, params in enumerate((plain, masked)):
        plan = StepPlan(step_id=0, new_requests=[NewRequestData(
            sequence_id=f"lp{i}", prompt_token_ids=[1, 40], params=params)],
            scheduled=[ScheduledRequest(sequence_id=f"lp{i}", start=0, num_tokens=2,
                                        new_block_ids=[1 + i])])
        results.append(runner.step(plan))
        runner.step(StepPlan(step_id=1, finished_sequence_ids=[f"lp{i}"]))
    assert results[1].sampled_token_ids == [ord("z")]
    assert results[0].logprobs[0].top_token_ids == results[1].logprobs[0].top_token_ids
    assert results[0].logprobs[0].top_logprobs == results[1].logprobs[0].top_logprobs


def _decode_with_preemption(runner, sequence_id: str, prompt: list[int], preempt_at: int | None,
                            max_tokens: int = 12) -> list[int]:
    """Greedy decode one constrained request; after `preempt_at` tokens its blocks are taken
    back and it is recomputed from its tokens, as the scheduler does under memory pressure."""
    params = SamplingParams(temperature=0.0, structured=LETTERS)
    tokens, out, blocks = list(prompt), [], [1, 2, 3, 4, 5, 6]
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(
        sequence_id=sequence_id, prompt_token_ids=prompt, params=params)], scheduled=[
        ScheduledRequest(sequence_id=sequence_id, start=0, num_tokens=len(prompt),
                         new_block_ids=blocks)])
    while True:
        result = runner.step(plan)
        assert result.error == "", result.error
        token = result.sampled_token_ids[0]
        out.append(token)
        tokens.append(token)
        if token == EOS or len(out) >= max_tokens:
            runner.step(StepPlan(step_id=99, finished_sequence_ids=[sequence_id]))
            return out
        if len(out) == preempt_at:  # recompute everything into other blocks
            plan = StepPlan(step_id=len(out), preempted_sequence_ids=[sequence_id], scheduled=[
                ScheduledRequest(sequence_id=sequence_id, start=0, num_tokens=len(tokens),
                                 new_block_ids=[10, 11, 12, 13, 14, 15])])
        else:
            plan = StepPlan(step_id=len(out), scheduled=[ScheduledRequest(
                sequence_id=sequence_id, start=len(tokens) - 1, num_tokens=1)])


def test_preemption_and_recompute_keep_the_matcher_in_step(runner):
    prompt = [1, 33, 90, 45]
    straight = _decode_with_preemption(runner, "straight", prompt, preempt_at=None)
    preempted = _decode_with_preemption(runner, "preempted", prompt, preempt_at=2)
    assert re.fullmatch("[a-z]{3,6}", text_of(straight))
    assert preempted == straight

"""Draft verification in the executor: greedy gives what one-by-one decoding gives (on a tiny
generated model), and the sampling rule leaves every token's distribution unchanged
(chi-square on 5,000 draws)."""

from __future__ import annotations

import pytest
import torch

from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.sampling.sampling_tensors import RequestSampling, SamplingTensors
from llmbus.services.executor.sampling.speculative import position_tensors, target_probs, verify
from tests.gguf_fixtures import GREEDY, TinySpec, generate, write_tiny_llama

BLOCK_SIZE = 4
PROMPT = [5, 9, 3, 17, 2, 11, 8]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, TinySpec())
    return ModelRunner(path, model_name="tiny", block_size=BLOCK_SIZE, num_blocks=64)


def test_greedy_drafts_give_the_tokens_of_plain_decoding(runner):
    expected = generate(runner, [PROMPT], max_tokens=12, sequence_ids=["plain"])[0]
    n = len(PROMPT)
    blocks = list(range(40, 45))  # 20 positions
    step = runner.step(StepPlan(step_id=100, new_requests=[NewRequestData("spec", PROMPT, GREEDY)],
                                scheduled=[ScheduledRequest("spec", 0, n, blocks)]))
    assert step.sampled_token_ids == expected[:1]
    # two right drafts, then a wrong one: both kept, the third replaced by the model's token
    drafts = [expected[1], expected[2], (expected[3] + 1) % 64, expected[4]]
    step = runner.step(StepPlan(step_id=101, scheduled=[ScheduledRequest(
        "spec", n, 1 + len(drafts), draft_token_ids=drafts)]))
    assert step.sampled_token_ids == expected[1:4] and step.num_sampled == [3]
    # the rejected drafts' KV is overwritten: go on from the last accepted position
    step = runner.step(StepPlan(step_id=102, scheduled=[ScheduledRequest(
        "spec", n + 3, 1 + 3, draft_token_ids=expected[4:7])]))
    assert step.sampled_token_ids == expected[4:8] and step.num_sampled == [4]  # all + 1
    step = runner.step(StepPlan(step_id=103, scheduled=[ScheduledRequest("spec", n + 7, 1)]))
    assert step.sampled_token_ids == expected[8:9]


def test_a_step_mixes_requests_with_and_without_drafts_and_their_logprobs(runner):
    params = SamplingParams(temperature=0.0, logprobs=2)
    expected = generate(runner, [PROMPT, PROMPT[::-1]], max_tokens=4,
                        params=[params, params], sequence_ids=["p0", "p1"])
    n = len(PROMPT)
    plan = StepPlan(step_id=200, new_requests=[NewRequestData("a", PROMPT, params),
                                               NewRequestData("b", PROMPT[::-1], params)],
                    scheduled=[ScheduledRequest("a", 0, n, [50, 51, 52]),
                               ScheduledRequest("b", 0, n, [53, 54, 55])])
    first = runner.step(plan)
    plan = StepPlan(step_id=201, scheduled=[
        ScheduledRequest("a", n, 1 + 2, draft_token_ids=expected[0][1:3]),
        ScheduledRequest("b", n, 1)])
    step = runner.step(plan)
    assert step.num_sampled == [3, 1]
    assert step.sampled_token_ids == expected[0][1:4] + expected[1][1:2]
    assert len(step.logprobs) == 4 and all(lp is not None for lp in step.logprobs)
    assert len(first.logprobs) == 2
    for lp, token in zip(step.logprobs, step.sampled_token_ids, strict=True):  # greedy: top 1
        assert lp.top_token_ids[0] == token and lp.logprob == pytest.approx(lp.top_logprobs[0])
        assert len(lp.top_token_ids) == 2 and lp.logprob < 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5,
                   repetition_penalty=1.3),
    SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=[0, 1, 2, 3, 4, 5, 6, 7])],
    ids=["penalties", "min_tokens"])
def test_drafts_see_penalties_and_bans_as_of_their_position(runner, params):
    """Each position is judged as if the drafts before it were accepted: penalties count
    them, min_tokens bans end where they would. Plain decoding's tokens as drafts are all
    accepted; a change at one position is caught there."""
    name = params.min_tokens and "bans" or "pen"
    expected = generate(runner, [PROMPT], max_tokens=10, params=[params],
                        sequence_ids=[f"plain-{name}"])[0]
    n = len(PROMPT)
    runner.step(StepPlan(step_id=400, new_requests=[NewRequestData(name, PROMPT, params)],
                         scheduled=[ScheduledRequest(name, 0, n, [62, 63, 56, 57, 58])]))
    step = runner.step(StepPlan(step_id=401, scheduled=[ScheduledRequest(
        name, n, 1 + 6, draft_token_ids=expected[1:7])]))
    assert step.sampled_token_ids == expected[1:8]
    step = runner.step(StepPlan(step_id=402, scheduled=[ScheduledRequest(
        name, n + 7, 1 + 2, draft_token_ids=[expected[8], (expected[9] + 1) % 64])]))
    assert step.sampled_token_ids == expected[8:10]


def test_each_position_counts_the_drafts_before_it():
    a, b, eos, x = 0, 1, 2, 3
    logits = torch.tensor([[5.0, 4.5, 0.0, 1.0]] * 3)  # a leads b by less than one penalty
    penalized = RequestSampling.from_params(
        SamplingParams(temperature=0.0, frequency_penalty=1.0), vocab_size=4)
    tensors = position_tensors(penalized, 0, [a, a], {x: 0.0}, "cpu")  # x: the prompt
    assert verify(logits, [a, a], tensors, None) == [a, b]  # the first a counts against it
    banned = RequestSampling.from_params(
        SamplingParams(temperature=0.0, min_tokens=7), eos_token_ids=[eos], vocab_size=4)
    logits = torch.tensor([[1.0, 0.0, 5.0, 2.0]] * 3)  # eos leads, x next
    tensors = position_tensors(banned, 5, [x, x], None, "cpu")  # 5 tokens out: 2 more banned
    assert verify(logits, [x, x], tensors, None) == [x, x, eos]


def test_drafts_are_refused_for_a_step_that_does_not_sample(runner):
    plan = StepPlan(step_id=300, new_requests=[NewRequestData("c", PROMPT, GREEDY)],
                    scheduled=[ScheduledRequest("c", 0, len(PROMPT) + 1, [60, 61],
                                                sample=False, draft_token_ids=[4])])
    assert "drafts" in runner.step(plan).error


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0  # never a token of probability 0
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()), int(kept.sum())


# 99.9th percentile of chi-square with 1..9 degrees of freedom: a correct sampler fails 1 in
# 1,000 runs per check, and the generator is seeded, so the test is deterministic.
CHI2_999 = [0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.2, top_p=0.8, logit_bias={3: 2.0})], ids=str)
def test_the_sampling_rule_keeps_each_position_s_distribution(params):
    vocab = 10
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    sampling = RequestSampling.from_params(params, vocab_size=vocab)
    tensors = SamplingTensors.build([sampling] * 3, "cpu")
    probs = target_probs(logits, tensors)
    likely = int(probs[0].argmax())
    drafts = [likely, int(probs[1].argmin())]  # often right, then (almost) always wrong
    generator = torch.Generator().manual_seed(7)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(5000):
        tokens = verify(logits, drafts, tensors, generator)
        first[tokens[0]] += 1
        if tokens[0] == likely:  # the first draft accepted: the next is drawn at position 1
            second[tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        statistic, support = _chi_square(counts, p)
        assert statistic < CHI2_999[support - 1], (counts.tolist(), p.tolist())


def test_seeded_verification_repeats_itself():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    sampling = RequestSampling.from_params(SamplingParams(temperature=1.0), vocab_size=12)
    tensors = SamplingTensors.build([sampling] * 4, "cpu")
    runs = [[verify(logits, [1, 2, 3], tensors, torch.Generator().manual_seed(5))
             for _ in range(1)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_the_sampling_rule_keeps_the_tiny_model_s_distribution(tmp_path):
    """The same on a tiny generated model's own logits at a prompt's end and two drafts: the
    first is its likeliest token, the second one it rarely picks (top-k 8: chi-square over
    8 tokens)."""
    from llmbus.services.executor.backends.torch_llama import LlamaModel
    from llmbus.services.executor.kv_cache import KVCache
    from llmbus.services.executor.weights.gguf_loader import load_gguf
    from tests.executor.reference_forward import paged_forward

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinySpec(), seed=9)
    config, dense, _ = load_gguf(path)
    model = LlamaModel(config, dense, max_positions=64)
    sampling = RequestSampling.from_params(SamplingParams(temperature=1.0, top_k=8),
                                           vocab_size=config.vocab_size)
    tensors = SamplingTensors.build([sampling] * 3, "cpu")

    def logits_of(tokens: list[int]) -> torch.Tensor:
        cache = KVCache(config, num_blocks=8, block_size=BLOCK_SIZE)
        return paged_forward(model, cache, [(tokens, 0, len(tokens), [1, 2, 3, 4])])

    likely = int(logits_of(PROMPT)[-1].argmax())
    second = target_probs(logits_of(PROMPT + [likely])[-1:], tensors)[0]
    rare = int(torch.where(second > 0, second, 2.0).argmin())  # in the top 8, least likely
    logits = logits_of(PROMPT + [likely, rare])[-3:]  # at the prompt's end and each draft
    probs = target_probs(logits, tensors)
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(2, config.vocab_size)
    for _ in range(5000):
        tokens = verify(logits, [likely, rare], tensors, generator)
        counts[0, tokens[0]] += 1
        if tokens[0] == likely:
            counts[1, tokens[1]] += 1
    for position in (0, 1):
        statistic, support = _chi_square(counts[position], probs[position])
        assert support == 8 and statistic < CHI2_999[support - 1], counts[position]

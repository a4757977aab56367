# Over 300 lines: every rung of the sampler's ladder, each with its own small cases.
"""The executor's sampler: filters, penalties, logit bias, min_tokens, seeds, logprobs.

Mostly on tiny hand-made logits; the last tests drive a ModelRunner over the tiny GGUF llama.
"""

from __future__ import annotations

import math
import random

import msgspec
import pytest
import torch

from llmbus.bus.messages import (
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.sampling.logprobs import MAX_LOGPROBS, token_logprobs
from llmbus.services.executor.sampling.penalties import TokenCounts, apply_penalties_
from llmbus.services.executor.sampling.sampler import process_logits, sample
from llmbus.services.executor.sampling.sampling_tensors import SamplingTensors
from llmbus.services.executor.sampling.truncation import (
    NUM_CANDIDATES,
    filter_logits,
    truncate_candidates,
)
from tests.gguf_fixtures import TinySpec, write_tiny_llama

EOS = 2
GREEDY = SamplingParams(temperature=0.0)


def _sample(logits, params, *, seed=0, generators=None, num_candidates=NUM_CANDIDATES,
            **build):
    tensors = SamplingTensors.from_params(params, eos_token_ids=[EOS],
                                          vocab_size=logits.shape[-1], **build)
    shared = torch.Generator().manual_seed(seed)
    return sample(logits, tensors, generators or [None] * len(params), shared, num_candidates)


# ---------------------------------------------------------------- filters


PROBS = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005])
FILTERS = [  # (params, tokens they allow)
    (SamplingParams(), range(10)),
    (SamplingParams(top_k=3), range(3)),
    (SamplingParams(top_p=0.7), range(4)),  # mass before token 3 is .65 < .7, before 4 .75
    (SamplingParams(min_p=0.25), range(5)),  # threshold .075: .08 stays, .07 goes
    # top-k 5 renormalizes to [.361 .241 .181 .120 .096]: top-p .9 drops token 4 (mass
    # before it .904), then min-p .4 drops what is under .4 * p(0): token 3.
    (SamplingParams(top_k=5, top_p=0.9, min_p=0.4), range(3)),
    (SamplingParams(temperature=0.5, top_k=4), range(4)),
]


# 256 candidates hold the whole vocabulary; 3 force most rows to the whole-vocabulary path.
@pytest.mark.parametrize("num_candidates", [NUM_CANDIDATES, 3])
def test_filters_sample_exactly_the_allowed_set_with_the_right_frequencies(num_candidates):
    num_draws = 3000
    params = [p for p, _ in FILTERS for _ in range(num_draws)]
    logits = PROBS.log().expand(len(params), -1)
    draws = _sample(logits, params, seed=7, num_candidates=num_candidates)
    draws = draws.view(len(FILTERS), num_draws)
    for (p, allowed), row in zip(FILTERS, draws, strict=True):
        assert set(row.tolist()) == set(allowed), p  # nothing outside, everything covered
        expected = torch.zeros(10)
        expected[list(allowed)] = PROBS[list(allowed)] ** (1.0 / p.temperature)
        expected /= expected.sum()
        frequencies = torch.bincount(row, minlength=10) / num_draws
        torch.testing.assert_close(frequencies, expected, atol=0.03, rtol=0.0)


def test_candidates_suffice_only_when_they_provably_hold_the_kept_set():
    # p = [.665, .245, .090, then 997 decreasing values worth .0004 in all]
    peaked = torch.cat([torch.tensor([12.0, 11.0, 10.0]), -torch.arange(997.0) / 100])
    flat = torch.zeros(1000)
    rows = [(peaked, SamplingParams(top_p=0.9), [0, 1]),  # mass before token 2: .9097
            (peaked, SamplingParams(top_k=10), list(range(10))),
            (peaked, SamplingParams(top_k=300, min_p=0.1), None),  # top-k past them
            (peaked, SamplingParams(min_p=0.1), [0, 1, 2]),
            (flat, SamplingParams(top_p=0.9), None),
            (flat, SamplingParams(min_p=0.5), None),
            (flat, SamplingParams(top_k=10), None)]  # ties with the 10th go past them
    logits = torch.stack([r[0] for r in rows])
    tensors = SamplingTensors.from_params([r[1] for r in rows])
    candidates, candidate_ids, fits = truncate_candidates(logits, torch.ones(len(rows)),
                                                          tensors, 256)
    assert fits.tolist() == [r[2] is not None for r in rows]
    for row, (_, _, kept) in enumerate(rows):
        if kept is not None:
            assert candidate_ids[row][candidates[row] > float("-inf")].tolist() == kept


def test_candidates_keep_what_whole_rows_keep_wherever_they_fit():
    rng = torch.Generator().manual_seed(4)
    num_rows, vocab_size = 240, 600
    spread = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(num_rows // 4)[:, None]
    logits = torch.randn(num_rows, vocab_size, generator=rng) * spread
    logits[::5] = logits[::5].round()  # ties
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in zip(torch.rand(num_rows, generator=rng).add(0.3).tolist(),
                                    [0, 0, 5, 40, 64, 100] * (num_rows // 6),
                                    [1.0, 0.5, 0.9, 0.97] * (num_rows // 4),
                                    [0.0, 0.0, 0.05, 0.2, 0.0] * (num_rows // 5), strict=True)]
    tensors = SamplingTensors.from_params(params)
    inv_temperature = 1 / tensors.temperature
    candidates, candidate_ids, fits = truncate_candidates(logits, inv_temperature, tensors, 64)
    whole = filter_logits(logits * inv_temperature[:, None], tensors.top_k, tensors.top_p,
                          tensors.min_p, tensors)
    assert 0.2 < fits.float().mean() < 0.9  # both kinds of rows are exercised
    for row in fits.nonzero()[:, 0].tolist():
        # The same logits survive (which of several tied tokens a top-p cut keeps may differ).
        kept = logits[row, candidate_ids[row][candidates[row] > float("-inf")]].sort().values
        expected = logits[row, whole[row] > float("-inf")].sort().values
        assert torch.equal(kept, expected), params[row]


def test_greedy_rows_ignore_filters_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]] * 3)
    params = [GREEDY, SamplingParams(temperature=1e-7, top_k=2),
              SamplingParams(temperature=0.0, top_p=0.1, min_p=0.9)]
    assert _sample(logits, params).tolist() == [1, 1, 1]


# ---------------------------------------------------------------- penalties

#             token:   0     1     2    3     4    5
RAW = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0, 1.0]])
PROMPT, OUTPUT = [0, 1, 3], [2, 2, 4]  # output counts: token 2 twice, token 4 once
PENALTY_CASES = [  # (repetition, frequency, presence, expected)
    # repetition 2 on seen {0, 1, 2, 3, 4}: positive / 2, non-positive * 2
    (2.0, 0.0, 0.0, [1.0, -2.0, 0.25, 0.0, -6.0, 1.0]),
    (1.0, 0.5, 0.0, [2.0, -1.0, -0.5, 0.0, -3.5, 1.0]),  # - 0.5 * count in the output
    (1.0, 0.0, 0.25, [2.0, -1.0, 0.25, 0.0, -3.25, 1.0]),  # - 0.25 once if in the output
    (2.0, 0.5, 0.25, [1.0, -2.0, -1.0, 0.0, -6.75, 1.0]),  # repetition first, then both
]


def _seen(prompt, output):
    counts = TokenCounts(num_slots=1, num_columns=2)  # grows to hold 5 distinct tokens
    return counts.gather([counts.add(prompt, output)])


@pytest.mark.parametrize(("repetition", "frequency", "presence", "expected"), PENALTY_CASES)
def test_penalties_change_logits_exactly_as_defined(repetition, frequency, presence, expected):
    token_ids, output_counts = _seen(PROMPT, OUTPUT)
    penalized = RAW.clone()
    apply_penalties_(penalized, torch.tensor([0]), token_ids, output_counts,
                     torch.tensor([presence]), torch.tensor([frequency]),
                     torch.tensor([repetition]))
    torch.testing.assert_close(penalized, torch.tensor([expected]), atol=0.0, rtol=0.0)

    # The same through a batch where only the middle row has penalties.
    params = [GREEDY, SamplingParams(repetition_penalty=repetition,
                                     frequency_penalty=frequency, presence_penalty=presence),
              SamplingParams(temperature=0.7)]
    tensors = SamplingTensors.from_params(params, penalty_counts=(token_ids, output_counts))
    processed = process_logits(RAW.expand(3, -1), tensors)
    torch.testing.assert_close(processed, torch.cat([RAW, torch.tensor([expected]), RAW]),
                               atol=0.0, rtol=0.0)


def test_token_counts_record_distinct_tokens_and_reuse_slots():
    counts = TokenCounts(num_slots=1, num_columns=1)
    slots = [counts.add([0, 0]), counts.add([1, 5, 1]), counts.add([5])]  # grows twice
    assert sorted(slots) == [0, 1, 2] and counts.num_slots == 4
    counts.record(slots, [3, 3, 5])
    counts.record(slots[:1], [3])
    token_ids, output_counts = counts.gather(slots)
    # Distinct tokens, prompt first; shorter rows repeat their column 0 (same id, same count).
    assert token_ids.tolist() == [[0, 3, 0], [1, 5, 3], [5, 5, 5]]
    assert output_counts.tolist() == [[0, 2, 0], [0, 0, 1], [1, 1, 1]]
    counts.release(slots[0])
    assert counts.add([2]) == slots[0]  # a released slot comes back cleared
    assert [t.tolist() for t in counts.gather([slots[0]])] == [[[2]], [[0.0]]]
    with pytest.raises(ValueError, match="seen no token"):
        counts.gather([counts.add([])])


def test_penalties_without_counts_are_refused():
    with pytest.raises(ValueError, match="penalty_counts"):
        SamplingTensors.from_params([SamplingParams(presence_penalty=1.0)])


# ---------------------------------------------------------------- logit bias, min_tokens


def test_logit_bias_can_force_or_forbid_a_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0, 3.0]] * 4)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=1.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={1: -100.0}),
              SamplingParams(temperature=0.0, logit_bias={999: 100.0, -1: 5.0})]  # dropped
    for seed in range(20):
        assert _sample(logits, params, seed=seed).tolist() == [3, 3, 4, 1]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 8.0]])  # eos (2) first, stop id 4 second
    for ignore_eos in (False, True):  # like vLLM: min_tokens bans eos even with ignore_eos
        params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4],
                                 ignore_eos=ignore_eos)]
        chosen = [_sample(logits, params, num_output_tokens=[n]).item() for n in range(5)]
        assert chosen == [3, 3, 3, 2, 2]
    free = [SamplingParams(temperature=0.0, stop_token_ids=[4])]
    assert _sample(logits, free, num_output_tokens=[0]).item() == 2


# ---------------------------------------------------------------- seeds


TRUNCATED = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02, seed=5,
                           logit_bias={7: 1.0}, logprobs=2)
PLAIN = SamplingParams(temperature=1.1, seed=5)  # samples over the whole vocabulary


@pytest.mark.parametrize("num_candidates", [NUM_CANDIDATES, 6])  # 6: paths change by step
@pytest.mark.parametrize("seeded", [TRUNCATED, PLAIN], ids=["truncated", "plain"])
def test_seeded_rows_ignore_the_rest_of_the_batch(num_candidates, seeded):
    vocab_size, num_steps = 40, 8
    others = [GREEDY, SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, seed=11), SamplingParams(logit_bias={3: 2.0}),
              SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[9], top_p=0.5)]
    step_logits = torch.randn(num_steps, vocab_size, generator=torch.Generator().manual_seed(0))
    # Peaked and flat steps alternate: with 6 candidates TRUNCATED fits every other step.
    step_logits *= torch.tensor([0.5, 4.0, 1.0, 6.0, 3.0, 8.0, 2.0, 5.0])[:, None]

    def run(params, row, shared_seed):
        generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
                      for p in params]
        tokens = []
        for step in range(num_steps):
            logits = torch.randn(len(params), vocab_size)  # whatever the neighbours have
            logits[row] = step_logits[step]
            tokens.append(_sample(logits, params, seed=shared_seed + step,
                                  generators=generators, num_candidates=num_candidates,
                                  num_output_tokens=[step] * len(params))[row].item())
        return tokens

    alone = run([seeded], 0, shared_seed=100)
    assert run([*others[:2], seeded, *others[2:]], 2, shared_seed=200) == alone
    assert run([seeded, *others], 0, shared_seed=300) == alone
    assert len(set(alone)) > 1  # it really sampled
    other_seed = msgspec.structs.replace(seeded, seed=6)
    assert run([other_seed], 0, shared_seed=100) != alone


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.8, top_k=10, logit_bias={4: 3.0}, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=0.0, logit_bias={7: 50.0}, logprobs=50)]
    token_ids = _sample(logits, params, seed=1)
    assert token_ids[4] == 7
    result = token_logprobs(logits, token_ids, [p.logprobs for p in params])
    raw = logits.log_softmax(-1)
    assert result[2] is None and len(result) == 5
    for row, k in [(0, 3), (1, 2), (3, 0), (4, MAX_LOGPROBS)]:
        entry = result[row]
        assert isinstance(entry, TokenLogprobs)
        assert entry.logprob == pytest.approx(raw[row, token_ids[row]].item(), abs=1e-6)
        top = raw[row].topk(k)
        assert entry.top_token_ids == top.indices.tolist()
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
    assert result[1].top_token_ids[0] == token_ids[1]  # greedy, unprocessed: the top-1
    assert result[1].logprob == result[1].top_logprobs[0]
    assert token_logprobs(logits, token_ids, [None] * 5) == []


# ---------------------------------------------------------------- through the ModelRunner

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, TinySpec())
    return ModelRunner(path, model_name="tiny", block_size=BLOCK_SIZE, num_blocks=128)


def _drive(runner, prompts, params, num_steps) -> list[StepResult]:
    """Prefill every prompt in step 0, then decode all of them together; forget them at the end.

    Each request gets enough blocks up front; results are checked for errors.
    """
    sequence_ids = [f"s{i}" for i in range(len(prompts))]
    next_block, results, tokens = 1, [], [list(p) for p in prompts]
    new, scheduled = [], []
    for sequence_id, prompt, p in zip(sequence_ids, prompts, params, strict=True):
        num_blocks = -(-(len(prompt) + num_steps) // BLOCK_SIZE)
        new.append(NewRequestData(sequence_id=sequence_id, prompt_token_ids=prompt, params=p))
        scheduled.append(ScheduledRequest(sequence_id=sequence_id, start=0,
                                          num_tokens=len(prompt),
                                          new_block_ids=list(range(next_block,
                                                                   next_block + num_blocks))))
        next_block += num_blocks
    for step_id in range(num_steps):
        result = runner.step(StepPlan(step_id=step_id, new_requests=new, scheduled=scheduled))
        assert result.error == "", result.error
        results.append(result)
        for seq, token_id in zip(tokens, result.sampled_token_ids, strict=True):
            seq.append(token_id)
        new, scheduled = [], [ScheduledRequest(sequence_id=r, start=len(seq) - 1, num_tokens=1)
                              for r, seq in zip(sequence_ids, tokens, strict=True)]
    runner.step(StepPlan(step_id=num_steps, finished_sequence_ids=sequence_ids))
    assert runner.requests == {}
    return results


def _outputs(results, row):
    return [r.sampled_token_ids[row] for r in results]


def _prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def test_runner_returns_logprobs_only_to_requests_that_ask(runner):
    prompts = _prompts([7, 12])
    results = _drive(runner, prompts, [SamplingParams(temperature=0.0, logprobs=2), GREEDY],
                     num_steps=5)
    for result in results:
        asked, silent = result.logprobs
        assert silent is None and isinstance(asked, TokenLogprobs)
        assert asked.top_token_ids[0] == result.sampled_token_ids[0]  # greedy = top-1
        assert len(asked.top_logprobs) == 2 and asked.top_logprobs[0] >= asked.top_logprobs[1]
        assert asked.logprob == asked.top_logprobs[0] and asked.logprob <= 0.0
        assert -math.log(256) < asked.logprob  # the argmax is likelier than uniform
    quiet = _drive(runner, prompts, [GREEDY, SamplingParams(temperature=1.0)], num_steps=2)
    assert all(r.logprobs == [] for r in quiet)


def test_runner_penalties_read_prompt_and_output_counts(runner):
    prompt = _prompts([9])[0]
    favourite = next(t for t in range(3, 256) if t not in prompt)
    in_prompt = prompt[0]

    def outputs(**params):
        return _outputs(_drive(runner, [prompt], [SamplingParams(temperature=0.0, **params)],
                               num_steps=8), 0)

    # A bias of 30 wins every step (logits spread ~3) until a penalty catches up with it.
    assert outputs(logit_bias={favourite: 30.0}) == [favourite] * 8
    once = outputs(logit_bias={favourite: 30.0}, presence_penalty=1e4)
    assert once[0] == favourite and favourite not in once[1:]
    # frequency 15: +30, +15, then +0 (its raw logit may win again), then -15 for good
    repeats = outputs(logit_bias={favourite: 30.0}, frequency_penalty=15.0)
    assert repeats[:2] == [favourite] * 2 and repeats.count(favourite) <= 3
    fresh = outputs(logit_bias={favourite: 30.0, in_prompt: 30.0}, repetition_penalty=1e3)
    assert fresh[0] == favourite and favourite not in fresh[1:] and in_prompt not in fresh
    assert len(runner.token_counts.free_slots) == runner.token_counts.num_slots  # released


def test_runner_min_tokens_counts_output_tokens(runner):
    eager_eos = SamplingParams(temperature=0.0, min_tokens=3, logit_bias={EOS: 1e3},
                               ignore_eos=True)
    outputs = _outputs(_drive(runner, _prompts([9]), [eager_eos], num_steps=5), 0)
    assert EOS not in outputs[:3] and outputs[3:] == [EOS, EOS]


def test_runner_seeded_request_ignores_a_batch_with_every_feature(runner):
    seeded = SamplingParams(temperature=1.0, top_k=50, min_p=0.01, seed=42,
                            frequency_penalty=0.5, repetition_penalty=1.2, logprobs=1)
    prompt, others = _prompts([11])[0], _prompts([4, 17, 8], seed=2)
    alone = _outputs(_drive(runner, [prompt], [seeded], num_steps=10), 0)
    batch_params = [SamplingParams(temperature=0.7, presence_penalty=0.3, logit_bias={9: 2.0}),
                    seeded, GREEDY, SamplingParams(temperature=1.0, seed=99, top_p=0.8,
                                                   min_tokens=5, logprobs=3)]
    batched = _drive(runner, [others[0], prompt, others[1], others[2]], batch_params,
                     num_steps=10)
    assert _outputs(batched, 1) == alone

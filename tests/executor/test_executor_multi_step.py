"""Multi-step decoding in the executor, on a tiny random model: a plan whose decodes take
several steps samples the tokens that as many one-step plans would (greedy, seeded, with
penalties and logprobs), and a plan that cannot hold them is refused."""

from __future__ import annotations

import pytest

from llmbus.bus.messages import (
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepProgress,
)
from llmbus.services.executor import multi_step
from llmbus.services.executor.multi_step import ProgressStream
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.sampling.sampled_tokens import SampledTokens
from tests.gguf_fixtures import TinySpec, generate, write_tiny_llama

PROMPTS = {"a": [1, 5, 9, 13], "b": [1, 7]}
PARAMS = {"a": SamplingParams(temperature=0.0, logprobs=2),
          "b": SamplingParams(temperature=1.0, seed=5, presence_penalty=0.5)}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, TinySpec())
    return ModelRunner(path, model_name="tiny", block_size=4, num_blocks=128)


def test_several_steps_a_plan_sample_what_one_step_plans_do(runner, monkeypatch):
    monkeypatch.setattr(multi_step, "STREAM_INTERVAL_SECONDS", 0.0)  # every forward streamed
    expected = generate(runner, list(PROMPTS.values()), max_tokens=9,
                        params=list(PARAMS.values()), sequence_ids=["x", "y"])
    first = runner.step(StepPlan(step_id=0, new_requests=[
        NewRequestData(r, PROMPTS[r], PARAMS[r]) for r in "ab"], scheduled=[
        ScheduledRequest("a", 0, 4, [1, 2, 3]), ScheduledRequest("b", 0, 2, [4, 5, 6])]))
    out = {"a": [first.sampled_token_ids[0]], "b": [first.sampled_token_ids[1]]}
    progress: list[StepProgress] = []
    runner.on_progress = progress.append
    for step_id, steps in ((1, {"a": 4, "b": 3}), (2, {"a": 4, "b": 5})):
        plan = StepPlan(step_id=step_id, scheduled=[ScheduledRequest(
            r, len(PROMPTS[r]) + len(out[r]) - 1, 1, num_steps=steps[r]) for r in "ab"])
        progress.clear()
        result = runner.step(plan)
        # each forward but the last, as it sampled: the result's tokens, forward by forward
        sampled = iter(result.sampled_token_ids)
        by_request = {r: [next(sampled) for _ in range(steps[r])] for r in "ab"}
        assert [(p.step_id, p.forward, p.sampled_token_ids) for p in progress] == [
            (step_id, k, [by_request[r][k] for r in "ab" if steps[r] > k])
            for k in range(max(steps.values()) - 1)]
        assert [len(p.logprobs) for p in progress] == [1 + (steps["b"] > k)
                                                       for k in range(len(progress))]
        assert result.error == "" and result.num_sampled == [steps["a"], steps["b"]]
        assert len(result.logprobs) == sum(steps.values())
        assert all(lp is not None for lp in result.logprobs[:steps["a"]])  # a asked for them
        assert all(lp is None for lp in result.logprobs[steps["a"]:])
        tokens = iter(result.sampled_token_ids)
        for r in "ab":
            out[r] += [next(tokens) for _ in range(steps[r])]
    assert out["a"] == expected[0] and out["b"] == expected[1]
    runner.on_progress = lambda _: None
    runner.step(StepPlan(step_id=3, finished_sequence_ids=["a", "b"]))


def test_a_plan_without_blocks_for_every_step_is_refused(runner):
    result = runner.step(StepPlan(step_id=0, new_requests=[
        NewRequestData("c", [1, 2, 3], PARAMS["a"])], scheduled=[
        ScheduledRequest("c", 0, 3, [7])]))
    assert result.error == ""
    result = runner.step(StepPlan(step_id=1, scheduled=[
        ScheduledRequest("c", 3, 1, num_steps=3)]))  # positions 3..5 need a second block
    assert "blocks cannot hold 6 tokens" in result.error
    result = runner.step(StepPlan(step_id=2, scheduled=[
        ScheduledRequest("c", 3, 2, num_steps=2, draft_token_ids=[5])]))
    assert "several steps are for a plain decode" in result.error
    runner.step(StepPlan(step_id=3, finished_sequence_ids=["c"]))


def test_progress_goes_out_once_the_interval_has_passed_with_every_forward_since():
    """Forwards of 4 ms and an interval of 10: the first message after the third forward
    (12 ms), with forwards 0-2; the next after the sixth, with 3-5."""
    clock = iter([0.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0])
    sent: list[StepProgress] = []
    stream = ProgressStream(7, sent.append, interval=10.0, clock=lambda: next(clock))
    for forward in range(6):
        stream(forward, SampledTokens([100 + forward, 200 + forward]))
    assert [(p.step_id, p.forward, p.num_forwards, p.sampled_token_ids, p.logprobs)
            for p in sent] == [(7, 0, 3, [100, 200, 101, 201, 102, 202], []),
                               (7, 3, 3, [103, 203, 104, 204, 105, 205], [])]


def test_the_interval_runs_from_when_tokens_last_went_out():
    """The plan before's result went out 2 ms before this plan's first forward began: with
    forwards of 4 ms and an interval of 10, the first message comes after the second forward
    (10 ms since the result), not the third; the next 10 ms after it."""
    clock = iter([4.0, 8.0, 12.0, 16.0, 20.0, 24.0])
    sent: list[StepProgress] = []
    stream = ProgressStream(7, sent.append, interval=10.0, clock=lambda: next(clock), since=-2.0)
    for forward in range(6):
        stream(forward, SampledTokens([100 + forward]))
    assert [(p.forward, p.num_forwards, p.sampled_token_ids) for p in sent] == [
        (0, 2, [100, 101]), (2, 3, [102, 103, 104])]

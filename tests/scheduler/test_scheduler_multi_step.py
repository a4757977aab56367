"""Multi-step decoding in the scheduler, against a fake executor that keeps real KV contents
(tests/scheduler/sim.py): the same tokens as one step at a time in a fraction of the plans,
never past max_tokens or a stop token, only while nothing waits and the batch is small, and
random traces with preemption, forks and aborts read only true KV."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.bus.messages import (
    FinishReason,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepProgress,
    StepResult,
)
from llmbus.services.scheduler.config import MULTI_STEP_MAX_BATCH
from llmbus.services.scheduler.step_time import StepTimeModel
from tests.scheduler.sim import (
    EOS,
    FakeExecutor,
    cycle,
    drive,
    operations,
    replay_trace,
    run,
)
from tests.scheduler.sim import make_speculative as make


def outputs(decode_steps: int, prompts: list[list[int]], params: SamplingParams, model):
    s = make(k=0, decode_steps=decode_steps)
    for i, prompt in enumerate(prompts):
        s.add_request(f"r{i}", "api", prompt, params)
    executor = FakeExecutor(model)
    plans, updates = drive(s, executor.run)
    tokens = {f"r{i}": [t for u in updates if u.request_id == f"r{i}" for t in u.new_token_ids]
              for i in range(len(prompts))}
    reasons = {u.request_id: u.finish_reason for u in updates if u.finish_reason}
    return plans, tokens, reasons


def test_several_tokens_a_plan_give_the_tokens_of_one_at_a_time():
    def model(_, tokens):
        return (tokens[-1] * 5 + len(tokens)) % 11 + 3

    params = SamplingParams(max_tokens=10, ignore_eos=True)  # not a multiple of the steps
    single_plans, single, _ = outputs(1, [[7, 8, 9], [4, 4]], params, model)
    multi_plans, multi, reasons = outputs(4, [[7, 8, 9], [4, 4]], params, model)
    assert multi == single and all(len(t) == 10 for t in multi.values())
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert len(multi_plans) * 2 < len(single_plans)
    steps = [i.num_steps for p in multi_plans for i in p.scheduled]
    assert max(steps) == 4 and sum(steps) >= 18  # all but each request's prefill step
    # no token is computed twice: each once, but the last one sampled
    computed = sum(i.num_tokens + i.num_steps - 1 for p in multi_plans for i in p.scheduled)
    assert computed == (3 + 10 - 1) + (2 + 10 - 1)


def test_a_stop_token_inside_the_steps_ends_the_request_there():
    params = SamplingParams(max_tokens=40)
    _, tokens, reasons = outputs(4, [[9, 8, 7]], params, cycle([5, 6, EOS, 1, 2]))
    _, single, _ = outputs(1, [[9, 8, 7]], params, cycle([5, 6, EOS, 1, 2]))
    assert tokens == single and tokens["r0"][-1] == EOS and len(tokens["r0"]) < 5
    assert reasons["r0"] == FinishReason.STOP


def test_one_step_at_a_time_while_requests_wait_or_the_batch_is_big():
    s = make(k=0, decode_steps=4, max_num_seqs=MULTI_STEP_MAX_BATCH + 1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for i in range(MULTI_STEP_MAX_BATCH + 2):  # one more than can run: it waits
        s.add_request(f"r{i}", "api", [3, 4, 5], params)
    executor = FakeExecutor(cycle([5, 6, 7]))
    in_flight: deque = deque()
    for _ in range(6):
        plan = s.schedule()
        assert all(i.num_steps == 1 for i in plan.scheduled), plan
        s.update(plan, executor.run(plan))
    assert s.waiting  # all this time
    run(s, executor, in_flight=in_flight)  # the rest finishes, with several steps at the end


def test_further_steps_never_preempt_another_request():
    """Two usable blocks of 4: both prompts fit one each. One step at a time, b ends before a
    needs its second block; a's 4 steps would want it at once, and take it from b."""
    s = make(k=0, decode_steps=4, num_blocks=3, prefix_caching=False)
    s.add_request("a", "api", [3, 4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    s.add_request("b", "api", [6, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    # one step at a time (planning ahead would want a's block before b's end is known)
    plans, updates = drive(s, FakeExecutor(cycle([5, 6, 7])).run, depth=1)
    assert s.counters.num_preemptions == 0
    assert sum(len(u.new_token_ids) for u in updates) == 7
    assert any(i.num_steps > 1 for p in plans for i in p.scheduled)  # once b's block is free


@settings(max_examples=150, deadline=None)
@given(operations, st.booleans(), st.integers(10, 24), st.integers(2, 5), st.booleans())
def test_random_traces_with_several_steps_read_only_true_kv(ops, prefix_caching, num_blocks,
                                                          decode_steps, disjoint_plans):
    """Arrivals, aborts, preemption, forks and steps planned ahead, with multi-step decoding
    (and a split engine's disjoint plans): every step attends to true tokens only, counts
    match owners, and everything finishes."""
    s = make(k=0, num_blocks=num_blocks, prefix_caching=prefix_caching,
             max_num_batched_tokens=16, max_num_seqs=6, max_model_len=48,
             decode_steps=decode_steps, disjoint_plans=disjoint_plans)

    def model(sequence_id, tokens):
        return EOS if (len(tokens) + len(sequence_id)) % 13 == 0 else len(tokens) % 9 + 3

    replay_trace(s, FakeExecutor(model), ops)


def paced_plans(forward_seconds: float, plan_seconds: float = 0.08) -> list[list[int]]:
    """Each plan's decode steps for one long request, the fake executor taking
    `forward_seconds` per forward."""
    s = make(k=0, decode_steps=8, decode_plan_seconds=plan_seconds)
    s.add_request("r", "api", [3, 4, 5], SamplingParams(max_tokens=60, ignore_eos=True))
    executor = FakeExecutor(cycle([5, 6, 7]))

    def timed(plan):
        result = executor.run(plan)
        result.forward_seconds = forward_seconds * max(i.num_steps for i in plan.scheduled)
        return result

    plans, updates = drive(s, timed)
    assert sum(len(u.new_token_ids) for u in updates) == 60
    return [[i.num_steps for i in p.scheduled] for p in plans]


def test_a_plan_takes_fewer_steps_when_forwards_are_slow():
    """Up to --decode-steps while a plan's forwards fit the plan time (80 ms here): 8 steps of a
    6 ms forward, 2 of a 30 ms one, 1 of a 100 ms one. The first decode plans go out before
    any forward was timed."""
    fast, medium, slow = paced_plans(0.006), paced_plans(0.03), paced_plans(0.1)
    assert max(max(p) for p in fast[3:]) == 8
    assert max(max(p) for p in medium[3:]) == 2
    assert max(max(p) for p in slow[3:]) == 1
    assert len(slow) > 3 * len(fast)


def test_a_context_longer_than_any_step_seen_takes_one_step_first():
    """A request whose KV another engine computed (disaggregated prefill) decodes at a context
    no step here attended to: its first plan takes one forward, whose time teaches the model
    what those keys cost, and only then several."""
    s = make(k=0, decode_steps=8, num_blocks=1024, max_model_len=4096,
             max_num_batched_tokens=4096)
    s.add_request("r", "api", list(range(3, 3003)), SamplingParams(max_tokens=20,
                                                                   ignore_eos=True))
    plan = s.schedule()  # the prompt's 3,000 tokens in one step, as a prefill engine's
    s.update(plan, StepResult(step_id=plan.step_id, sampled_token_ids=[7]))
    model = StepTimeModel()  # ... which this engine never observed: it saw 64-token steps
    model.observe(StepPlan(step_id=0, scheduled=[ScheduledRequest("a", 0, 64)]), 0.05)
    model.observe(StepPlan(step_id=1, scheduled=[ScheduledRequest("a", 64, 1)]), 0.005)
    assert model.longest_context == 65
    assert model.knows_context(65 * 5 // 4 + 64) and not model.knows_context(3001)
    s.swap(step_time=model)
    [item] = s.schedule().scheduled
    assert item.num_steps == 1
    model.observe(StepPlan(step_id=2, scheduled=[ScheduledRequest("r", 3000, 1)]), 0.02)
    assert model.knows_context(3001)


def progress_of(plan: StepPlan, result: StepResult, group: int = 1) -> list[StepProgress]:
    """The StepProgress messages the executor sends for a plan (every forward but its last,
    `group` forwards a message), made from the plan's full result."""
    samplers = [i for i in plan.scheduled if i.sample]
    counts = result.num_sampled or [1] * len(samplers)
    tokens, offset = {}, 0
    for item, count in zip(samplers, counts, strict=True):
        tokens[item.sequence_id] = result.sampled_token_ids[offset:offset + count]
        offset += count
    last = max(i.num_steps for i in samplers) - 1
    return [StepProgress(step_id=plan.step_id, forward=k, num_forwards=min(group, last - k),
                         sampled_token_ids=[tokens[i.sequence_id][f]
                                            for f in range(k, min(k + group, last))
                                            for i in samplers if i.num_steps > f])
            for k in range(0, last, group)]


def streamed_outputs(prompts: list[list[int]], params: SamplingParams, model,
                     deliver=lambda progress: progress, group: int = 1):
    """outputs(4, ...), each plan's progress streamed before its result (`deliver` may drop
    or reorder them): the tokens per request, the finish reasons, and the updates."""
    s = make(k=0, decode_steps=4)
    for i, prompt in enumerate(prompts):
        s.add_request(f"r{i}", "api", prompt, params)
    executor = FakeExecutor(model)

    def step(plan: StepPlan) -> StepResult:
        result = executor.run(plan)
        if any(i.num_steps > 1 for i in plan.scheduled):
            for progress in deliver(progress_of(plan, result, group)):
                streamed.append(s.stream(plan, progress))
                s.check_invariants()
        return result

    streamed: list[list] = []
    _, updates = drive(s, step, depth=1)  # nothing planned behind a multi-step plan
    updates = [u for batch in streamed for u in batch] + updates
    tokens = {f"r{i}": [t for u in sorted(updates, key=lambda u: u.num_before)
                        if u.request_id == f"r{i}" for t in u.new_token_ids]
              for i in range(len(prompts))}
    reasons = {u.request_id: u.finish_reason for u in updates if u.finish_reason}
    return tokens, reasons, streamed


def model_with_a_stop(sequence_id, tokens):
    """r0 says EOS as its 6th output token (inside a plan of 4 steps); r1 never."""
    if sequence_id == "r0" and len(tokens) == 3 + 5:
        return EOS
    return (tokens[-1] * 5 + len(tokens)) % 11 + 3


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("deliver", [
    lambda progress: progress,  # in order
    lambda progress: progress[:1],  # the rest lost
    lambda progress: progress[1:],  # the first lost: nothing after it is taken
    lambda progress: progress[::-1],  # the wrong order: only the first forward's is taken
], ids=["in-order", "rest-lost", "first-lost", "reversed"])
def test_tokens_streamed_as_the_forwards_sample_them_are_those_of_the_result(deliver, group):
    """A message a forward (group 1) or every two: the same tokens, streamed; messages lost or
    out of order leave theirs to the result."""
    params = SamplingParams(max_tokens=10)
    expected, expected_reasons = outputs(4, [[7, 8, 9], [4, 4]], params, model_with_a_stop)[1:]
    tokens, reasons, streamed = streamed_outputs([[7, 8, 9], [4, 4]], params,
                                                 model_with_a_stop, deliver, group)
    assert tokens == expected and reasons == expected_reasons
    assert reasons["r0"] is FinishReason.STOP and len(tokens["r0"]) == 6
    early = [u for batch in streamed for u in batch]
    assert all(1 <= len(u.new_token_ids) <= group for u in early)
    if deliver(list(range(3))) == [0, 1, 2]:  # in order: all but each plan's last forward
        # plans of 4 steps after each prefill: r0 3 tokens, then its EOS; r1 3 and 3
        assert sum(len(u.new_token_ids) for u in early) == 3 + 1 + 3 + 3
        assert any(u.finish_reason is FinishReason.STOP for u in early)  # r0 ended streaming


def test_updates_waiting_to_go_go_before_the_streamed_tokens():
    """An update made between steps (here an abort's; a first token from a prefill engine's
    too) goes out ahead of the next streamed tokens: the detokenizer takes a completion's
    updates in order, and a gap is a lost message to it."""
    s = make(k=0, decode_steps=4)
    for name in ("r0", "r1"):
        s.add_request(name, "api", [7, 8, 9], SamplingParams(max_tokens=10, ignore_eos=True))
    executor = FakeExecutor(lambda _, tokens: 5)
    first = s.schedule()
    s.update(first, executor.run(first))
    plan = s.schedule()
    assert [i.num_steps for i in plan.scheduled] == [4, 4]
    result = executor.run(plan)
    s.abort_request("r1")
    [progress, *_] = progress_of(plan, result)
    updates = s.stream(plan, progress)
    assert [(u.request_id, u.finish_reason) for u in updates] == [
        ("r1", FinishReason.ABORT), ("r0", FinishReason.NONE)]


@pytest.mark.parametrize("disjoint_plans", [False, True])
def test_a_split_engine_plans_ahead_only_what_the_plan_in_flight_does_not_sample(
        disjoint_plans):
    """A whole engine plans a's decode behind the step that samples its token (the executor
    takes them in turn); a split engine's lead computes the next plan while the first is in
    its other shards, so that plan has only b's next chunk, and a's decode follows the
    result."""
    s = make(k=0, num_blocks=32, max_num_batched_tokens=8, disjoint_plans=disjoint_plans)
    s.add_request("a", "api", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    s.add_request("b", "api", list(range(10, 30)), SamplingParams(max_tokens=4))
    first, second = s.schedule(), s.schedule()
    assert [(i.sequence_id, i.start, i.sample) for i in first.scheduled] == [
        ("a", 0, True), ("b", 0, False)]
    ahead = [(i.sequence_id, i.start) for i in second.scheduled]
    assert ahead == ([("b", 5)] if disjoint_plans else [("a", 3), ("b", 5)])
    s.update(first, StepResult(step_id=first.step_id, sampled_token_ids=[7]))
    third = [(i.sequence_id, i.start) for i in s.schedule().scheduled]
    assert ("a", 3 if disjoint_plans else 4) in third


def test_a_split_engine_with_nothing_to_overlap_plans_the_decodes_ahead():
    """Decodes alone: the plan behind them is theirs, which the lead takes as soon as the
    one in flight ends, with no round trip to the scheduler between."""
    s = make(k=0, num_blocks=32, disjoint_plans=True)
    s.add_request("a", "api", [3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    first = s.schedule()
    second = s.schedule()
    assert [(i.sequence_id, i.start) for i in first.scheduled] == [("a", 0)]
    assert [(i.sequence_id, i.start) for i in second.scheduled] == [("a", 3)]

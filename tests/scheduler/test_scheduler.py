"""The scheduler core alone: exact block ids, chunked prefill, preemption, aborts, no leaks."""

from __future__ import annotations

import pytest

from llmbus.bus.messages import (
    FinishReason,
    ResumedCompletion,
    SamplingParams,
    StepResult,
    TokenLogprobs,
)
from llmbus.services.scheduler.admission import AdmissionError
from llmbus.services.scheduler.block_allocator import BlockAllocator
from tests.scheduler.sim import EOS, add, make, run_step


def test_allocator_reserves_null_block_and_recycles_in_order():
    allocator = BlockAllocator(5)
    assert allocator.allocate(2) == [1, 2]
    assert allocator.allocate(2) == [3, 4]
    assert allocator.num_free == 0
    allocator.free([3, 1])
    assert allocator.allocate(2) == [3, 1]
    with pytest.raises(AssertionError):
        allocator.free([2, 2])


def test_prefill_then_decode_exact_blocks_and_deltas():
    s = make()
    add(s, "a", num_prompt=6)
    plan, updates = run_step(s)
    [item] = plan.scheduled
    assert (item.start, item.num_tokens, item.new_block_ids, item.sample) == (0, 6, [1, 2], True)
    assert [r.sequence_id for r in plan.new_requests] == ["a"]
    assert updates[0].new_token_ids == [7]
    # Token 7 sits at position 6: block 2 still has room, so no new block is sent.
    plan, _ = run_step(s)
    assert (plan.scheduled[0].start, plan.scheduled[0].new_block_ids) == (6, [])
    assert plan.new_requests == []
    plan, _ = run_step(s)  # position 7: still block 2
    assert plan.scheduled[0].new_block_ids == []
    plan, updates = run_step(s)  # position 8 starts block 3; 4th token ends it (max_tokens=4)
    assert plan.scheduled[0].new_block_ids == [3]
    assert updates[0].finish_reason == FinishReason.LENGTH
    assert s.kv.allocator.num_free == s.kv.allocator.num_usable
    assert s.schedule().finished_sequence_ids == ["a"]


def test_long_prompt_is_prefilled_in_chunks_behind_running_decodes():
    s = make(num_blocks=20, max_num_batched_tokens=8)
    add(s, "short", num_prompt=3, max_tokens=10)
    run_step(s)
    add(s, "long", num_prompt=20)
    plan, updates = run_step(s)
    # The decode goes first (1 token); the long prompt takes the rest of the budget (7).
    assert [(i.sequence_id, i.start, i.num_tokens, i.sample) for i in plan.scheduled] == [
        ("short", 3, 1, True), ("long", 0, 7, False)]
    assert [u.request_id for u in updates] == ["short"]
    plan, _ = run_step(s)
    assert [(i.sequence_id, i.start, i.num_tokens) for i in plan.scheduled] == [
        ("short", 4, 1), ("long", 7, 7)]
    plan, updates = run_step(s)
    assert [(i.sequence_id, i.start, i.num_tokens, i.sample) for i in plan.scheduled] == [
        ("short", 5, 1, True), ("long", 14, 6, True)]
    assert {u.request_id for u in updates} == {"short", "long"}


def test_newest_request_is_preempted_and_recomputed():
    s = make(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    add(s, "old", num_prompt=8, max_tokens=8)
    add(s, "new", num_prompt=8, max_tokens=8)
    plan, _ = run_step(s)
    assert [i.new_block_ids for i in plan.scheduled] == [[1, 2], [3, 4]]
    # Each decode now needs a third block and none is free: the newest request gives way.
    plan, _ = run_step(s)
    assert [(i.sequence_id, i.new_block_ids) for i in plan.scheduled] == [("old", [3])]
    assert plan.preempted_sequence_ids == ["new"]  # the executor drops its block table first
    assert s.counters.num_preemptions == 1
    assert [r.sequence_id for r in s.waiting] == ["new"]
    while s.table.get("old"):
        plan, _ = run_step(s)
    plan, _ = run_step(s)
    [item] = plan.scheduled
    # Recomputed from the start: 8 prompt tokens + the 1 token sampled before preemption.
    assert (item.sequence_id, item.start, item.num_tokens) == ("new", 0, 9)
    assert item.new_block_ids == [1, 2, 3]  # "old" freed [1, 2, 3, 4] in table order
    assert plan.new_requests == []  # the executor still has its tokens


def test_abort_frees_blocks_wherever_the_request_is():
    s = make()
    add(s, "running", num_prompt=5)
    run_step(s)
    add(s, "queued", num_prompt=5)
    assert s.abort_request("running") and s.abort_request("queued")
    assert not s.abort_request("unknown")
    assert s.kv.allocator.num_free == s.kv.allocator.num_usable
    updates = s.take_ended_updates()
    assert [(u.request_id, u.finish_reason) for u in updates] == [
        ("running", FinishReason.ABORT), ("queued", FinishReason.ABORT)]
    assert s.schedule().finished_sequence_ids == ["running"]


def test_a_withdrawn_request_leaves_silently_or_is_refused_when_it_comes():
    """The router gave up on this engine's admission and sent the request elsewhere: running
    or queued, it goes without an update or a count (the other engine serves the client);
    withdrawn before it arrived, it is refused when it does."""
    s = make()
    add(s, "running", num_prompt=5, n=2)
    run_step(s)
    add(s, "queued", num_prompt=5)
    s.withdraw("running")
    s.withdraw("queued")
    assert not s.table.sequences and not s.table.families
    assert s.kv.allocator.num_free == s.kv.allocator.num_usable
    s.check_invariants()
    assert s.take_ended_updates() == [] and s.take_finished() == [] and s.counters.num_finished == 0
    assert "running#prompt" in s.schedule().finished_sequence_ids  # the executor forgets it
    s.withdraw("late")
    with pytest.raises(AdmissionError, match="withdrawn"):
        add(s, "late", num_prompt=5)
    add(s, "late", num_prompt=5)  # the withdrawal is used up
    assert s.table.get("late")


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make()
    add(s, "eos", num_prompt=3)
    _, updates = run_step(s, token=EOS)
    assert updates[0].finish_reason == FinishReason.STOP
    add(s, "ignore", num_prompt=3, max_tokens=2, ignore_eos=True)
    _, updates = run_step(s, token=EOS)
    assert updates[0].finish_reason == FinishReason.NONE
    add(s, "stop-id", num_prompt=3, stop_token_ids=[7])
    _, updates = run_step(s, token=7)
    assert {u.request_id: u.finish_reason for u in updates}["stop-id"] == FinishReason.STOP


def test_requests_that_can_never_fit_are_refused():
    s = make(num_blocks=5, block_size=4, max_model_len=64)  # cache: 16 tokens
    with pytest.raises(AdmissionError, match="context length"):
        add(s, "a", num_prompt=64)
    with pytest.raises(AdmissionError, match="max_tokens can be at most"):
        add(s, "b", num_prompt=60, max_tokens=5)
    with pytest.raises(AdmissionError, match="KV cache"):
        add(s, "c", num_prompt=10, max_tokens=10)
    request = add(s, "d", num_prompt=10, max_tokens=0)  # 0 = as much as fits
    assert request.max_tokens == 6


def test_executor_failure_fails_every_request_and_frees_blocks():
    s = make()
    add(s, "a", num_prompt=5)
    add(s, "b", num_prompt=5)
    run_step(s)
    updates = s.fail_all("boom")
    assert {u.request_id: u.finish_reason for u in updates} == {
        "a": FinishReason.ERROR, "b": FinishReason.ERROR}
    assert all(u.error == "boom" for u in updates)
    assert s.kv.allocator.num_free == s.kv.allocator.num_usable and not s.has_work


def test_a_resumed_completion_sends_the_logprobs_of_its_new_tokens():
    """A completion moved here with tokens it streamed elsewhere has no logprobs for them; each
    new token's logprobs go out with that token (not aligned with the replayed tokens)."""
    s = make()
    s.add_request("r", "api.x", [10, 11, 12], SamplingParams(max_tokens=6, logprobs=0),
                  resumed=[ResumedCompletion(index=0, output_token_ids=[20, 21])])
    first, second = TokenLogprobs(logprob=-0.5), TokenLogprobs(logprob=-1.5)
    for sampled in (first, second):
        plan = s.schedule()
        [update] = s.update(plan, StepResult(step_id=plan.step_id, sampled_token_ids=[7],
                                             logprobs=[sampled]))
        assert (update.new_token_ids, update.logprobs) == ([7], [sampled])

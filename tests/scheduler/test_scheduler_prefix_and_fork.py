"""Prefix cache, copy-on-write forks, planning ahead, and random traces with invariant checks."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.bus.messages import BlockCopy, FinishReason, StepResult
from tests.scheduler.sim import EOS, add, arrive_or_abort, make, run_step


def drain(s, token: int = 7, max_steps: int = 100):
    for _ in range(max_steps):
        if not s.has_work:
            return
        run_step(s, token)
        s.check_invariants()
    raise AssertionError("requests did not finish")


def test_prefix_cache_reuses_full_blocks():
    s = make(num_blocks=9, block_size=4, prefix_caching=True)
    add(s, "a", num_prompt=10, max_tokens=1)
    plan, _ = run_step(s)
    assert plan.scheduled[0].new_block_ids == [1, 2, 3]
    assert s.kv.tree.num_cached_blocks == 2  # the two full blocks; block 3 is partial
    assert s.kv.allocator.num_free == 6  # block 3 went back; 1 and 2 stay cached
    add(s, "b", num_prompt=10, max_tokens=1)
    plan, _ = run_step(s)
    [item] = plan.scheduled
    assert (item.start, item.num_tokens, item.new_block_ids) == (8, 2, [1, 2, 4])
    assert (s.counters.num_prefix_query_tokens, s.counters.num_prefix_hit_tokens) == (20, 8)
    s.check_invariants()


def test_a_request_waiting_for_blocks_is_looked_up_once():
    """The queue head that cannot get blocks is matched again every step; the prefix-cache
    counters count its lookup once, when it is admitted (else the hit rate sinks)."""
    s = make(num_blocks=5, block_size=4, prefix_caching=True)  # 4 usable blocks
    add(s, "a", num_prompt=12, max_tokens=4)  # 3 blocks now, a 4th as it decodes
    add(s, "b", num_prompt=8, max_tokens=1)  # 2 blocks: waits until a is done
    steps_b_waited = 0
    while not any(r.request_id == "b" for r in s.running) and s.has_work:
        steps_b_waited += len(s.waiting) > 0
        run_step(s)
        s.check_invariants()
    assert steps_b_waited >= 3
    drain(s)
    assert s.counters.num_prefix_query_tokens == 12 + 8


def test_whole_prompt_cached_still_computes_its_last_token():
    s = make(num_blocks=9, block_size=4, prefix_caching=True)
    add(s, "a", num_prompt=8, max_tokens=1)
    run_step(s)
    add(s, "b", num_prompt=8, max_tokens=1)
    plan, _ = run_step(s)
    [item] = plan.scheduled
    assert (item.start, item.num_tokens, item.new_block_ids) == (4, 4, [1, 3])


def test_least_recently_used_leaves_are_evicted_first():
    s = make(num_blocks=7, block_size=4, prefix_caching=True)  # 6 usable blocks
    add(s, "a", num_prompt=8, max_tokens=1, first_token=100)
    run_step(s)  # caches [1, 2]
    add(s, "b", num_prompt=8, max_tokens=1, first_token=200)
    run_step(s)  # caches [3, 4]
    add(s, "c", num_prompt=12, max_tokens=1, first_token=100)  # extends a's prefix
    plan, _ = run_step(s)
    assert plan.scheduled[0].new_block_ids == [1, 2, 5]
    assert sorted(s.kv.tree.nodes_by_block) == [1, 2, 3, 4, 5] and s.kv.allocator.num_free == 1
    add(s, "d", num_prompt=12, max_tokens=1, first_token=300)
    plan, _ = run_step(s)
    # b's chain was used least recently: its leaf (4) goes first, then its parent (3).
    assert plan.scheduled[0].new_block_ids == [6, 4, 3]
    assert s.kv.tree.nodes_by_block[4].key == (304, 305, 306, 307)  # now d's second block
    assert s.kv.tree.match(list(range(200, 208)), 2) == []  # b is gone from the cache
    assert s.kv.tree.match(list(range(100, 112)), 3) == [1, 2, 5]  # a and c are still there
    s.check_invariants()


def test_no_prefix_caching_frees_everything():
    s = make(prefix_caching=False)
    add(s, "a", num_prompt=10, max_tokens=1)
    run_step(s)
    assert s.kv.tree is None and s.kv.allocator.num_free == s.kv.allocator.num_usable


def test_fork_shares_the_prompt_and_copies_the_partial_block():
    s = make(num_blocks=12, block_size=4)
    add(s, "p", num_prompt=6, max_tokens=2, n=3)
    plan, updates = run_step(s)
    [item] = plan.scheduled  # the prompt but its last token, once, without sampling
    assert (item.sequence_id, item.start, item.num_tokens, item.sample) == ("p#prompt", 0, 5,
                                                                          False)
    assert item.new_block_ids == [1, 2] and updates == []
    plan, updates = run_step(s)
    assert plan.finished_sequence_ids == ["p#prompt"]
    assert [r.sequence_id for r in plan.new_requests] == ["p#0", "p#1", "p#2"]
    # Position 5 lies in shared block 2: the first two copy it, the last writes in place.
    assert plan.copy_blocks == [BlockCopy(src=2, dst=3), BlockCopy(src=2, dst=4)]
    assert [(i.start, i.num_tokens, i.new_block_ids, i.sample) for i in plan.scheduled] == [
        (5, 1, [1, 3], True), (5, 1, [1, 4], True), (5, 1, [1, 2], True)]
    assert [(u.request_id, u.index) for u in updates] == [("p", 0), ("p", 1), ("p", 2)]
    assert s.kv.allocator.ref_counts[1] == 3
    s.check_invariants()
    _, updates = run_step(s)
    assert [u.finish_reason for u in updates] == [FinishReason.LENGTH] * 3
    assert s.kv.allocator.num_free == s.kv.allocator.num_usable


def test_seeded_completions_get_distinct_seeds():
    s = make()
    add(s, "p", num_prompt=6, n=2, seed=5)
    run_step(s)
    plan, _ = run_step(s)
    assert [r.params.seed for r in plan.new_requests] == [5, 6]


def test_abort_one_completion_or_all():
    s = make(num_blocks=12)
    add(s, "p", num_prompt=6, max_tokens=5, n=3)
    run_step(s)
    run_step(s)
    assert s.abort_request("p", index=1)
    assert sorted(r.index for r in s.running) == [0, 2]
    assert s.abort_request("p")
    assert not s.has_work and s.kv.allocator.num_free == s.kv.allocator.num_usable
    assert [(u.index, u.finish_reason) for u in s.take_ended_updates()] == [
        (1, FinishReason.ABORT), (0, FinishReason.ABORT), (2, FinishReason.ABORT)]


def test_planning_ahead_counts_pending_tokens_and_drops_late_ones():
    s = make()
    add(s, "a", num_prompt=3, max_tokens=3)
    plan1 = s.schedule()
    plan2 = s.schedule()  # before step 1's result: assumes its token is coming
    assert [(i.start, i.num_tokens) for i in plan2.scheduled] == [(3, 1)]
    [update] = s.update(plan1, StepResult(step_id=0, sampled_token_ids=[7]))
    assert update.new_token_ids == [7]
    plan3 = s.schedule()
    assert [(i.start, i.num_tokens) for i in plan3.scheduled] == [(4, 1)]
    [update] = s.update(plan2, StepResult(step_id=1, sampled_token_ids=[EOS]))
    assert update.finish_reason == FinishReason.STOP
    assert s.update(plan3, StepResult(step_id=2, sampled_token_ids=[9])) == []
    assert s.schedule().finished_sequence_ids == ["a"]
    assert s.kv.allocator.num_free == s.kv.allocator.num_usable


def test_no_step_past_max_tokens_while_planning_ahead():
    s = make()
    add(s, "a", num_prompt=3, max_tokens=1)
    s.schedule()
    assert s.schedule().scheduled == []  # its only token is already on the way


operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 3), st.integers(0, 8),
              st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(0, 60)),
    st.tuples(st.just("result")),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations, st.booleans(), st.integers(8, 24))
def test_random_traces_keep_every_invariant(ops, prefix_caching, num_blocks):
    """Arrivals, aborts, steps planned ahead, results: counts always match owners; nothing
    leaks; every request finishes."""
    s = make(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
             max_model_len=48, prefix_caching=prefix_caching)
    in_flight: deque = deque()
    ids = []

    def result():
        plan = in_flight.popleft()
        num = sum(i.sample for i in plan.scheduled)
        tokens = [EOS if (plan.step_id + k) % 11 == 0 else 5 + k % 3 for k in range(num)]
        s.update(plan, StepResult(step_id=plan.step_id, sampled_token_ids=tokens))

    for op in ops:
        if arrive_or_abort(s, op, ids):
            pass  # an arrival or an abort, applied
        elif op[0] == "step" and len(in_flight) < 2:
            in_flight.append(s.schedule())
        elif op[0] == "result" and in_flight:
            result()
        s.check_invariants()

    for _ in range(2000):  # no starvation: everything admitted finishes
        if not s.has_work and not in_flight:
            break
        if len(in_flight) < 2 and s.has_work:
            in_flight.append(s.schedule())
        else:
            result()
        s.check_invariants()
    assert not s.has_work and not in_flight
    assert s.table.sequences == {} and s.table.families == {}
    if s.kv.tree is not None:
        assert all(s.kv.allocator.ref_counts[b] == 1 for b in s.kv.tree.nodes_by_block)
        s.kv.tree.evict(s.kv.tree.num_cached_blocks)
        assert s.kv.tree.num_cached_blocks == 0
    assert s.kv.allocator.num_free == s.kv.allocator.num_usable

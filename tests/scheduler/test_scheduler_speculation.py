"""Speculative decoding in the scheduler, against a fake executor that keeps real KV contents:
each step checks that every position a request attends to holds its true token (never a
rejected draft, a stale cached block or an uncopied shared one), then writes its query there."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.bus.messages import (
    FinishReason,
    SamplingParams,
    StructuredOutput,
)
from tests.scheduler.sim import (
    BLOCK,
    EOS,
    FakeExecutor,
    cycle,
    drive,
    operations,
    replay_trace,
    run,
)
from tests.scheduler.sim import make_speculative as make


def test_a_repeating_output_is_verified_several_tokens_a_step():
    s = make(k=4)
    s.add_request("r", "api", [9, 8, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    executor = FakeExecutor(cycle([5, 6, 7, 1]))
    plans = run(s, executor)
    assert executor.tokens["r"][3:] == [1, 5, 6, 7] * 10
    drafted = [i for p in plans for i in p.scheduled if i.draft_token_ids]
    counters = s.counters
    assert drafted and counters.num_accepted_tokens == counters.num_draft_tokens  # exact cycle
    assert len(plans) < 40 / 2  # several tokens per step once the cycle shows
    assert max(len(i.draft_token_ids) for i in drafted) == 4


def test_a_constrained_request_gets_no_drafts():
    """Its grammar matcher in the executor only goes forward (executor/constraints.py)."""
    s = make(k=4)
    s.add_request("r", "api", [9, 8, 7], SamplingParams(
        max_tokens=40, ignore_eos=True, structured=StructuredOutput(kind="json_object")))
    executor = FakeExecutor(cycle([5, 6, 7, 1]))
    plans = run(s, executor)
    assert executor.tokens["r"][3:] == [1, 5, 6, 7] * 10
    assert not any(i.draft_token_ids for p in plans for i in p.scheduled)


def test_the_output_with_drafts_is_the_output_without():
    def model(_, tokens):  # follows its last token, but slips every 9 positions
        return (tokens[-1] * 7 + (len(tokens) % 9 == 0)) % 11 + 3

    outputs = []
    for k in (0, 3):
        s = make(k=k, n_min=1)
        s.add_request("r", "api", [3, 4, 5, 3, 4], SamplingParams(max_tokens=60, ignore_eos=True))
        _, updates = drive(s, FakeExecutor(model).run)
        outputs.append([t for u in updates for t in u.new_token_ids])
        if k:
            counters = s.counters
            assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # some wrong
    assert outputs[0] == outputs[1] and len(outputs[0]) == 60


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    s = make(k=4)
    s.add_request("r", "api", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=30))
    model = cycle([5, 6, 7])  # after the prompt: 7, 5, 6, 7, ...
    executor = FakeExecutor(lambda rid, tokens: EOS if len(tokens) == 11 else model(rid, tokens))
    _, updates = drive(s, executor.run, depth=1)
    tokens = [t for u in updates for t in u.new_token_ids]
    assert tokens == [7, 5, 6, EOS] and updates[-1].finish_reason == FinishReason.STOP


def test_drafts_stop_at_max_tokens():
    s = make(k=8)
    s.add_request("r", "api", [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    plans = run(s, FakeExecutor(cycle([5, 6])))
    for plan in plans:
        for item in plan.scheduled:  # never more tokens than max_tokens allows
            assert len(item.draft_token_ids) <= 5 - 1
    assert s.counters.num_finished == 1


def test_misses_back_off_and_the_cache_holds_true_tokens():
    s = make(k=4)
    s.add_request("r", "api", [1, 2, 3, 4], SamplingParams(max_tokens=40, ignore_eos=True))
    # 1, 2, 3, then a new token: "1, 2, 3" always matches, what followed it never again
    executor = FakeExecutor(lambda _, tokens: (1, 2, 3, 10 + len(tokens))[len(tokens) % 4])
    plans = run(s, executor)
    drafted = [p.step_id for p in plans for i in p.scheduled if i.draft_token_ids]
    assert s.counters.num_accepted_tokens == 0 and 2 <= len(drafted) <= 3  # then 8, 16 tokens apart
    for node in s.kv.tree.nodes_by_block.values():
        assert [executor.kv[node.block_id, i] for i in range(BLOCK)] == list(node.key)


def test_penalties_and_min_tokens_speculate_too():
    """The executor applies them at every verified position (test_executor_speculative)."""
    for params in (SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.5),
                   SamplingParams(max_tokens=20, min_tokens=19)):
        s = make(k=4)
        s.add_request("r", "api", [5, 6, 5, 6, 5, 6], params)
        plans = run(s, FakeExecutor(cycle([5, 6])))
        assert any(i.draft_token_ids for p in plans for i in p.scheduled)


@settings(max_examples=150, deadline=None)
@given(operations, st.booleans(), st.integers(10, 24), st.integers(1, 4), st.integers(2, 5))
def test_random_traces_with_drafts_read_only_true_kv(ops, prefix_caching, num_blocks, k,
                                                    period):
    """Arrivals, aborts, preemption, forks, steps planned ahead, drafts partly right: every
    step attends to true tokens only, counts match owners, and everything finishes."""
    s = make(k=k, num_blocks=num_blocks, prefix_caching=prefix_caching, n_min=1,
             max_num_batched_tokens=16, max_num_seqs=6, max_model_len=48)

    def model(sequence_id, tokens):  # repeats with a period, but slips now and then
        value = tokens[-period] if len(tokens) > period else 5
        return EOS if (len(tokens) + len(sequence_id)) % 13 == 0 else (
            value if len(tokens) % 7 else value + 1)

    replay_trace(s, FakeExecutor(model), ops)



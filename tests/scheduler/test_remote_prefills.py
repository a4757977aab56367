"""A decode engine's books of the prompts a prefill engine prefills for it (the scheduler core:
blocks held, the first token handed over, a try given up, aborts, stale answers, counts), and a
prefill engine's door (what it refuses). Pure: no bus, no model."""

from __future__ import annotations

import asyncio
import dataclasses

from msgspec.structs import replace

from llmbus.bus.messages import (
    FinishReason,
    Heartbeat,
    KvDestination,
    KvLayout,
    PrefillRequest,
    SamplingParams,
    StepResult,
)
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.disaggregation.remote_prefill_bus import PrefillSide
from llmbus.services.scheduler.disaggregation.rule import DisaggregationRule
from llmbus.services.scheduler.request import RequestStatus
from llmbus.services.scheduler.scheduler import Scheduler
from tests.scheduler.sim import add_prompt as add
from tests.scheduler.sim import decode_engine, linear_model
from tests.scheduler.sim import prefill_heartbeat as engine


def test_a_remote_prefill_holds_its_blocks_and_hands_over_the_first_token():
    s = decode_engine()
    r = add(s, "a", list(range(10, 20)))  # 10 tokens: 3 blocks of 4
    plan = s.schedule(now=1.0)
    assert not plan.scheduled and r.status is RequestStatus.REMOTE
    [start] = s.remote.tries.take_starts()
    assert (start.engine_id, start.first_block, r.block_table) == ("P", 0, [1, 2, 3])
    assert s.kv.num_free == 39 - 3
    s.check_invariants()
    assert s.remote.done(start.transfer_id, 42, None, now=2.0)
    assert r.status is RequestStatus.RUNNING and r.output_token_ids == [42]
    [update] = s.take_ended_updates()
    assert update.new_token_ids == [42] and update.start is not None
    plan = s.schedule()
    assert plan.closed_transfers == [start.transfer_id]  # the executor takes no more
    [item] = plan.scheduled
    assert (item.start, item.num_tokens, item.new_block_ids) == (10, 1, [1, 2, 3])
    [new] = plan.new_requests
    assert new.output_token_ids == [42] and new.kv_destination is None
    assert not s.remote.done(start.transfer_id, 43, None)  # a duplicate answer
    s.check_invariants()


def test_a_cached_prefix_stays_here_and_only_the_rest_is_asked_for():
    s = decode_engine()
    s.swap(dataclasses.replace(s.config, disaggregation=None))
    first = add(s, "warm", list(range(10, 22)), max_tokens=1)  # caches its 3 full blocks
    plan = s.schedule()
    first_blocks = list(first.block_table)
    s.update(plan, StepResult(step_id=plan.step_id, sampled_token_ids=[5]))
    assert first.status is RequestStatus.FINISHED
    s.swap(dataclasses.replace(s.config, disaggregation=DisaggregationRule(mode="always")))
    r = add(s, "b", list(range(10, 22)) + [7, 8, 9])  # 15 tokens, 12 of them cached
    s.schedule()
    [start] = s.remote.tries.take_starts()
    assert start.first_block == 3 and r.num_computed_tokens == 12
    assert len(r.block_table) == 4 and r.block_table[:3] == first_blocks


def test_a_try_given_up_prefills_here_first():
    s = decode_engine()
    add(s, "x", list(range(30, 34)))
    r = add(s, "a", list(range(10, 20)))
    s.schedule()
    starts = {t.request.request_id: t for t in s.remote.tries.take_starts()}
    assert s.remote.failed(starts["a"].transfer_id)
    assert s.kv.num_free == 39 - 1  # "x" holds one block; "a" gave its three back
    assert r.status is RequestStatus.WAITING and s.waiting[0] is r and r.remote.local_only
    assert s.remote.tries.take_cancels()[0].transfer_id == starts["a"].transfer_id
    plan = s.schedule()
    assert starts["a"].transfer_id in plan.closed_transfers
    item = next(i for i in plan.scheduled if i.sequence_id == "a")
    assert (item.start, item.num_tokens, len(item.new_block_ids)) == (0, 10, 3)
    assert not s.remote.done(starts["a"].transfer_id, 9, None)  # too late: dropped
    s.check_invariants()


def test_an_abort_of_a_remote_prefill_frees_its_blocks_and_cancels_it():
    s = decode_engine()
    add(s, "a", list(range(10, 20)))
    s.schedule()
    [start] = s.remote.tries.take_starts()
    assert s.abort_request("a")
    assert s.kv.num_free == 39 and not s.remote.tries.by_transfer
    assert [c.transfer_id for c in s.remote.tries.take_cancels()] == [start.transfer_id]
    assert s.has_bookkeeping  # the close goes out even to an idle executor
    assert s.schedule().closed_transfers == [start.transfer_id]
    [update] = s.take_ended_updates()
    assert update.finish_reason is FinishReason.ABORT
    s.check_invariants()


def test_fail_all_ends_remote_prefills_too():
    s = decode_engine()
    add(s, "a", list(range(10, 20)))
    s.schedule()
    updates = s.fail_all("the executor failed")
    assert [u.request_id for u in updates] == ["a"] and s.kv.num_free == 39
    s.check_invariants()


def test_a_prefill_engine_request_carries_its_destination():
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4, max_model_len=64,
                                  eos_token_ids=(2,), role="prefill"))
    destination = KvDestination(transfer_id="a>1", engine_id="D", first_block=1,
                                block_ids=[7, 8])
    s.add_request("a>1", "engine.D.prefilled", list(range(10, 20)),
                  SamplingParams(max_tokens=1), kv_destination=destination)
    plan = s.schedule()
    assert plan.new_requests[0].kv_destination == destination


# ---------------------------------------------------------------- the prefill engine's door


async def test_a_prefill_engine_refuses_another_layout_and_takes_its_own():
    mine = KvLayout(dtype="float32", block_size=4, num_layers=30, num_kv_heads=3, head_dim=64)
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4, max_model_len=64,
                                  eos_token_ids=(2,), role="prefill"))
    side = PrefillSide(None, s, "P", mine, asyncio.Event(), refuse=lambda _: "")
    destination = KvDestination(transfer_id="a>1", engine_id="D", first_block=0,
                                block_ids=[5, 6, 7])

    def ask(layout: KvLayout) -> PrefillRequest:
        return PrefillRequest(request_id="a", attempt=0, prompt_token_ids=list(range(10, 20)),
                              params=SamplingParams(max_tokens=50, min_tokens=3),
                              destination=destination, layout=layout,
                              reply_subject="engine.D.prefilled")

    for other in (replace(mine, dtype="float16"), replace(mine, block_size=16),
                  replace(mine, num_kv_heads=4)):
        reply = await side.on_prefill(ask(other), None)
        assert reply.error.startswith("KV layout mismatch") and "prefill engine P" in reply.error
        assert not s.table.holds("a>1")
    assert (await side.on_prefill(ask(mine), None)).error == ""
    held = s.table.get("a>1")
    assert held.remote.kv_destination == destination and held.max_tokens == 1  # one token, then D's
    assert held.params.min_tokens == 1 and held.params.stop == []
    busy = PrefillSide(None, s, "P", mine, asyncio.Event(), refuse=lambda n: f"busy {n}")
    assert (await busy.on_prefill(ask(mine), None)).error == "busy 10"
    # a prefill for a LoRA adapter is taken only once this engine's executor holds it; one
    # that serves no adapters says so, and holds nothing for it
    tuned = replace(ask(mine), destination=replace(destination, transfer_id="b>1"),
                    params=SamplingParams(max_tokens=50, adapter="tuned"))
    reply = await side.on_prefill(tuned, None)
    assert "serves none" in reply.error and not s.table.holds("b>1")



def test_a_request_the_rule_keeps_here_is_not_weighed_again():
    s = decode_engine()
    s.swap(dataclasses.replace(s.config, disaggregation=DisaggregationRule(min_tokens=64)))
    r = add(s, "a", list(range(10, 20)))  # 10 tokens: too short to send away
    plan = s.schedule()
    assert [i.sequence_id for i in plan.scheduled] == ["a"] and r.remote.local_only
    [(request, decision)] = s.remote.take_decisions()
    assert request is r and "10 < 64" in decision.reason
    s.schedule()
    assert s.remote.take_decisions() == []


def test_a_burst_counts_what_it_sent_before_the_next_heartbeat():
    s = decode_engine()
    s.remote.prefill_engines = [Heartbeat(service="scheduler", instance_id="p1", engine_id="P",
                                   role="prefill", num_free_blocks=2, num_evictable_blocks=1,
                                   block_size=4)]  # room for 12 tokens: free or evictable
    first, second = add(s, "a", list(range(10, 20))), add(s, "b", list(range(30, 40)))
    s.schedule()
    assert first.status is RequestStatus.REMOTE  # 3 blocks: 2 free + 1 evictable there
    assert second.status is RequestStatus.RUNNING
    assert "room" in s.remote.take_decisions()[-1][1].reason
    [engine] = s.remote.prefill_engines
    assert (engine.num_queued_tokens, engine.num_free_blocks) == (10, -1)


def test_requests_prefilled_elsewhere_count_against_max_num_seqs():
    s = decode_engine()
    s.swap(dataclasses.replace(s.config, max_num_seqs=2))
    for name in "abc":
        add(s, name, list(range(10, 20)))
    s.schedule()
    assert len(s.remote) == 2 and [r.request_id for r in s.waiting] == ["c"]


def test_the_rule_weighs_the_decodes_of_the_step_it_plans():
    """A prompt beside this step's decodes goes away; the same prompt on an idle engine
    would stay (test_an_idle_decode_engine_prefills_itself)."""
    s = decode_engine()
    s.swap(dataclasses.replace(s.config, disaggregation=DisaggregationRule(
        min_tokens=8, kv_bytes_per_token=1, bytes_per_second=1e12, handover_seconds=0.0)))
    s.swap(step_time=linear_model())
    s.remote.prefill_engines = []  # the first request decodes here
    first = add(s, "a", list(range(10, 14)), max_tokens=50)
    plan = s.schedule()
    s.update(plan, StepResult(step_id=plan.step_id, sampled_token_ids=[5]))
    assert first.status is RequestStatus.RUNNING
    s.remote.prefill_engines = [engine()]
    add(s, "b", list(range(20, 60)))
    s.schedule()
    [(_, decision)] = s.remote.take_decisions()
    assert decision.engine is not None, decision.reason

"""Disaggregated prefill: the rule that decides per request where a prompt is prefilled, one
test per condition (services/scheduler/disaggregation/rule.py). Pure: no bus, no model; the
engine's books of remote prefills are tests/scheduler/test_remote_prefills.py."""

from __future__ import annotations

import dataclasses

import pytest

from llmbus.bus.messages import (
    SamplingParams,
    StructuredOutput,
)
from llmbus.services.scheduler.disaggregation.rule import (
    DisaggregationRule,
    decide,
    local_prefill_seconds,
    prefill_seconds,
)
from llmbus.services.scheduler.request import Request
from llmbus.services.scheduler.step_time import RELATIVE_STEP, StepShape, StepTimeModel
from tests.scheduler.sim import PREFILL_BLOCK as BLOCK
from tests.scheduler.sim import linear_model
from tests.scheduler.sim import prefill_heartbeat as engine

RULE = DisaggregationRule(min_tokens=512, max_cached_fraction=0.5, max_queued_tokens=4096,
                          handover_seconds=0.02, kv_bytes_per_token=23040,
                          bytes_per_second=300e6)


def request(num_prompt: int, **params) -> Request:
    return Request("r", "r", 0, "api.x", list(range(num_prompt)),
                   SamplingParams(max_tokens=8, **params), max_tokens=8)


def decodes(rows: int) -> StepShape:
    shape = StepShape()
    for _ in range(rows):
        shape.add(100, 1)
    return shape


def test_the_model_used_is_the_formula():
    model = linear_model()
    assert model.predict(StepShape(1, 256, 0.0)) == pytest.approx(0.005 + 0.002 + 0.256)
    assert prefill_seconds(model, 0, 512, 256) == pytest.approx(2 * 0.263)


def test_a_long_uncached_prompt_beside_decodes_goes_remote():
    decision = decide(RULE, request(2000), 0, [engine()], linear_model(), decodes(16), 256,
                      0.06)
    assert decision.engine is not None and decision.engine.instance_id == "p1"
    assert "there" in decision.reason


@pytest.mark.parametrize("params", [{"structured": StructuredOutput(kind="json_object")}])
def test_a_constrained_request_stays(params):
    assert decide(RULE, request(2000, **params), 0, [engine()], linear_model(), decodes(16),
                  256, 0.06).engine is None


def test_a_parent_of_n_completions_and_a_resumed_request_stay():
    parent = request(2000)
    parent.num_forks = 4
    resumed = request(2000)
    resumed.output_token_ids = [5, 6]
    for r in (parent, resumed):
        assert decide(RULE, r, 0, [engine()], linear_model(), decodes(16), 256,
                      0.06).engine is None


def test_a_short_effective_prompt_stays():
    decision = decide(RULE, request(511), 0, [engine()], linear_model(), decodes(16), 256, 0.06)
    assert decision.engine is None and "511 < 512" in decision.reason
    assert decide(RULE, request(512), 0, [engine()], linear_model(), decodes(16), 256,
                  0.06).engine is not None


def test_a_mostly_cached_prompt_stays():
    # 2000 long, 1024 cached here: 976 effective (above min_tokens) but 51% cached
    decision = decide(RULE, request(2000), 1024, [engine()], linear_model(), decodes(16), 256,
                      0.06)
    assert decision.engine is None and "cached here" in decision.reason
    assert decide(RULE, request(2000), 992, [engine()], linear_model(), decodes(16), 256,
                  0.06).engine is not None  # 49.6% cached


def test_no_prefill_engine_or_none_with_room():
    model, shape = linear_model(), decodes(16)
    assert decide(RULE, request(2000), 0, [], model, shape, 256, 0.06).engine is None
    busy = engine(queued=4097)  # saturated: more queued than max_queued_tokens
    full = engine(free_blocks=2000 // BLOCK - 1, instance="p2")  # one block short
    for rule in (RULE, dataclasses.replace(RULE, mode="always")):
        decision = decide(rule, request(2000), 0, [busy, full], model, shape, 256, 0.06)
        assert decision.engine is None and "room" in decision.reason
    ok = engine(queued=4096, free_blocks=2000 // BLOCK, instance="p3")  # just enough
    assert decide(dataclasses.replace(RULE, mode="always"), request(2000), 0,
                  [busy, full, ok], model, shape, 256, 0.06).engine.instance_id == "p3"


def test_the_least_queued_prefill_engine_is_chosen():
    engines = [engine(queued=900, instance="a"), engine(queued=100, instance="b")]
    assert decide(RULE, request(2000), 0, engines, linear_model(), decodes(16), 256,
                  0.06).engine.instance_id == "b"


def test_an_idle_decode_engine_prefills_itself():
    # Nothing decodes here: the prefill takes whole steps here as there, and the transfer
    # and handover only add to it.
    decision = decide(RULE, request(2000), 0, [engine()], linear_model(), StepShape(), 256,
                      0.06)
    assert decision.engine is None and "here" in decision.reason


def test_the_prediction_decides_where_remote_is_slower():
    # A prefill engine with a long queue: its wait outweighs the chunks here.
    model, shape = linear_model(), decodes(2)
    local = local_prefill_seconds(model, shape, 0, 2000, 256, 0.06)
    queued = engine(queued=4000)
    there = (prefill_seconds(model, 0, 4000, 256) + prefill_seconds(model, 0, 2000, 256)
             + 2000 * 23040 / 300e6 + 0.02)
    assert there > local  # the arithmetic the rule must follow
    assert decide(RULE, request(2000), 0, [queued], model, shape, 256, 0.06).engine is None
    assert decide(RULE, request(2000), 0, [engine()], model, shape, 256, 0.06).engine


def test_local_chunks_beside_decodes_follow_the_step_cap():
    # 16 decodes cost 0.005 + 16·0.002 + 16·0.001 = 0.053 s, over half the 0.06 s target: a
    # step may take RELATIVE_STEP x 0.053 = 0.106 s, room for the prompt's row and 51 tokens
    # (0.053 + 0.002 + 0.051), so 2000 tokens take 40 steps.
    assert RELATIVE_STEP == 2.0  # the arithmetic below
    model, shape = linear_model(), decodes(16)
    seconds = local_prefill_seconds(model, shape, 0, 2000, 256, 0.06)
    steps = -(-2000 // 51)
    assert seconds == pytest.approx(steps * (0.053 + 0.002) + 2000 * 0.001)
    # 2 decodes (0.011 s) keep a fixed target: (0.0605 - 0.011 - 0.002) / 0.001 = 47.5 tokens
    seconds = local_prefill_seconds(model, decodes(2), 0, 2000, 256, 0.0605)
    assert seconds == pytest.approx(-(-2000 // 47) * (0.011 + 0.002) + 2000 * 0.001)


def test_without_step_times_only_decodes_stalling_send_it_away():
    fresh = StepTimeModel()
    assert decide(RULE, request(2000), 0, [engine()], fresh, decodes(4), 256, 0.06).engine
    assert decide(RULE, request(2000), 0, [engine()], fresh, StepShape(), 256,
                  0.06).engine is None


def test_always_and_never():
    always = dataclasses.replace(RULE, mode="always")
    never = dataclasses.replace(RULE, mode="never")
    assert decide(always, request(20), 0, [engine()], linear_model(), StepShape(), 256, 0.06)\
        .engine is not None
    assert decide(never, request(5000), 0, [engine()], linear_model(), decodes(64), 256,
                  0.06).engine is None
    assert decide(always, request(2000), 0, [engine(queued=5000)], linear_model(),
                  StepShape(), 256, 0.06).engine is None  # saturated all the same



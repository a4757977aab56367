"""The pipeline page's data (services/api/pipeline.py): copies by stage, engine load, token
rates, recent requests. Pure: heartbeats, stats and times are made up here."""

from __future__ import annotations

import pytest

from llmbus.bus.messages import EngineStats, Heartbeat
from llmbus.services.api.pipeline import (
    NUM_RECENT_SHOWN,
    STAGE_ORDER,
    RecentRequests,
    TokenRates,
    pipeline_view,
)


def test_a_rate_needs_two_samples_apart_then_spans_the_window():
    rates = TokenRates(window=5.0, min_span=0.5)
    assert rates.observe("e0", 100, now=10.0) is None
    assert rates.observe("e0", 120, now=10.25) is None  # too close to say
    assert rates.observe("e0", 150, now=11.0) == 50.0  # (150 - 100) / 1 s
    for t in range(12, 20):
        rates.observe("e0", 150 + 10 * (t - 11), now=float(t))
    # Samples older than the window are dropped, but one at least `window` old is kept.
    assert rates.observe("e0", 240, now=20.0) == 10.0  # (240 - 190) / (20 - 15)


def test_a_restarted_engine_starts_its_rate_again():
    rates = TokenRates()
    rates.observe("e0", 1000, now=0.0)
    assert rates.observe("e0", 5, now=1.0) is None  # its count went back: a new process
    assert rates.observe("e0", 25, now=2.0) == 20.0


def test_recent_requests_keep_the_newest_and_age_the_running_ones():
    recent = RecentRequests("a1", size=2)
    recent.started("r1", created=100.0, num_prompt_tokens=5, trace_id="ab")
    recent.started("r2", created=101.0, num_prompt_tokens=6, trace_id="")
    recent.ended("r1", status="finished", finish_reason="stop", num_output_tokens=7,
                 ttft_seconds=0.5, seconds=1.5)
    recent.started("r3", created=102.0, num_prompt_tokens=8, trace_id="cd")  # r1 falls out
    recent.ended("r1", status="aborted", finish_reason="", num_output_tokens=0,
                 ttft_seconds=None, seconds=0.0)  # gone: nothing to update
    r2, r3 = recent.snapshot(now=104.0)
    assert (r2.request_id, r2.status, r2.seconds, r2.replica) == ("r2", "running", 3.0, "a1")
    assert (r3.request_id, r3.seconds) == ("r3", 2.0)
    recent.ended("r3", status="aborted", finish_reason="", num_output_tokens=4,
                 ttft_seconds=None, seconds=0.75)
    [_, r3] = recent.snapshot(now=200.0)
    assert (r3.status, r3.seconds, r3.ttft_seconds, r3.num_output_tokens) == (
        "aborted", 0.75, -1.0, 4)


def _beat(service: str, instance_id: str, **load) -> Heartbeat:
    return Heartbeat(service=service, instance_id=instance_id, **load)


def test_the_view_lists_every_stage_in_order_and_engines_with_their_load():
    copies = {
        "detokenizer": [(_beat("detokenizer", "d2"), 0.3), (_beat("detokenizer", "d1"), 0.1)],
        "scheduler": [(_beat("scheduler", "s1", engine_id="engine1", num_running=9,
                             num_total_blocks=10, num_free_blocks=9), 0.2),
                      (_beat("scheduler", "s0", engine_id="engine0", role="decode"), 0.4)],
        "api": [(_beat("api", "a1"), 0.0)],
        "executor": [(_beat("executor", "x1", engine_id="engine0", shard="1/2",
                            adapters=["sql-lora"]), 0.1),
                     (_beat("executor", "x0", engine_id="engine0", shard="0/2",
                            adapters=["sql-lora", "poet"]), 0.1)]}
    stats = [EngineStats(engine_id="engine0", num_steps=1, num_running=3, num_waiting=2,
                         num_free_blocks=60, num_total_blocks=100, max_batch_size=4,
                         num_preemptions=1, num_finished=5, num_evictable_blocks=15,
                         num_prefix_query_tokens=200, num_prefix_hit_tokens=50)]
    view = pipeline_view(model="m", replica="a1", copies=copies, stats=stats,
                         rates={"engine0": 12.5}, recent=[], trace_url=None)
    assert [s["name"] for s in view["stages"]] == list(STAGE_ORDER)
    stages = {s["name"]: s["copies"] for s in view["stages"]}
    assert stages["tokenizer"] == []  # none alive: shown empty
    lead, shard = stages["executor"]  # a layer shard of a split executor says which it is
    assert (shard["engine_id"], shard["shard"]) == ("engine0", "1/2")
    assert "engine" not in shard  # the engine's load is its scheduler's
    # The LoRA adapters resident in each executor process, and in each engine (all of them)
    assert (lead["adapters"], shard["adapters"]) == (["poet", "sql-lora"], ["sql-lora"])
    assert [c["instance_id"] for c in stages["detokenizer"]] == ["d1", "d2"]
    engine0, engine1 = stages["scheduler"]
    assert engine0["engine"] == {"role": "decode", "num_running": 3, "num_waiting": 2,
                                 "kv_usage": 0.25, "prefix_hit_rate": 0.25,
                                 "tokens_per_second": 12.5, "num_preemptions": 1,
                                 "adapters": ["poet", "sql-lora"]}
    # No stats from engine1 (it missed the gather): its heartbeat's load, nothing invented.
    assert engine1["engine"] == {"role": "mixed", "num_running": 9, "num_waiting": 0,
                                 "kv_usage": 0.1, "prefix_hit_rate": None,
                                 "tokens_per_second": None, "num_preemptions": None,
                                 "adapters": []}
    assert "engine" not in stages["api"][0]
    assert view["tracing"] is False


@pytest.mark.parametrize("trace_url", [None, "http://jaeger:16686/trace/{trace_id}"])
def test_recent_requests_are_the_newest_of_every_copy_with_trace_links(trace_url):
    a1, a2 = RecentRequests("a1"), RecentRequests("a2")
    for i in range(NUM_RECENT_SHOWN + 5):
        (a1 if i % 2 else a2).started(f"r{i}", created=float(i), num_prompt_tokens=1,
                                      trace_id=f"{i:032x}" if i % 3 else "")
    view = pipeline_view(model=None, replica="a1", copies={}, stats=[], rates={},
                         recent=a1.snapshot(100.0) + a2.snapshot(100.0), trace_url=trace_url)
    shown = view["recent_requests"]
    assert [r["id"] for r in shown] == [f"r{i}" for i in range(NUM_RECENT_SHOWN + 4, 4, -1)]
    assert {r["replica"] for r in shown} == {"a1", "a2"}
    linked = {r["id"]: r["trace_url"] for r in shown}
    assert linked["r7"] == (None if trace_url is None
                            else f"http://jaeger:16686/trace/{7:032x}")
    assert linked["r9"] is None  # no trace id, no link

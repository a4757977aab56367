"""One trace per request across every service, metrics that add up, logs that carry ids."""

from __future__ import annotations

import io
import json
import re
import time
from contextlib import redirect_stderr

import httpx
import openai
import pytest

from llmbus.bus.logging import configure_logging
from tests.stack import API_KEY, AUTH, MODEL_NAME

pytestmark = pytest.mark.model

SERVICES = {f"llmbus-{s}" for s in ("api", "tokenizer", "scheduler", "executor", "detokenizer")}


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def _trace_of(otlp, request_id: str, timeout: float = 10.0):
    """Spans of the trace whose root carries `request_id`, once every service reported."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = otlp.snapshot()
        roots = [s for s in spans if s.attributes.get("llmbus.request_id") == request_id
                 and s.service == "llmbus-api" and not s.parent_span_id]
        if roots:
            trace = [s for s in spans if s.trace_id == roots[0].trace_id]
            if {s.service for s in trace} >= SERVICES and any(
                    s.name == "engine.decode" for s in trace):
                return roots[0], trace, spans
        time.sleep(0.2)
    raise AssertionError(f"no complete trace for {request_id}")


def test_one_request_is_one_trace_across_all_five_services(client, otlp):
    reply = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=6, stream=True,
        messages=[{"role": "user", "content": "Say hello to tracing."}])
    request_id = next(iter(reply)).id
    list(reply)
    root, trace, everything = _trace_of(otlp, request_id)
    by_name = {s.name: s for s in trace}
    for name in ("tokenize", "engine.queue", "engine.prefill", "engine.prefill_chunk",
                 "engine.decode", "executor.request", "detokenize", "sse_stream"):
        assert name in by_name, f"missing span {name}"
    for name in ("tokenize", "engine.queue", "engine.prefill", "engine.decode",
                 "executor.request", "detokenize", "sse_stream"):
        assert by_name[name].parent_span_id == root.span_id, name
    assert by_name["engine.prefill_chunk"].parent_span_id == by_name["engine.prefill"].span_id
    # Timing order (one machine, one clock; 5 ms of slack for clock reads in other processes).
    slack = 5_000_000
    queue, prefill, decode = (by_name[n] for n in ("engine.queue", "engine.prefill",
                                                   "engine.decode"))
    assert root.start_ns <= by_name["tokenize"].start_ns + slack
    assert queue.end_ns <= prefill.start_ns + slack
    assert prefill.end_ns <= decode.start_ns + slack
    assert decode.end_ns <= root.end_ns + slack
    assert root.attributes["gen_ai.request.model"] == MODEL_NAME
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    # Executor steps are their own spans, linked to every request they served.
    steps = [s for s in everything if s.name == "executor.step"
             and (root.trace_id, root.span_id) in s.links]
    # a prefill step, then decode steps (several tokens each, multi-step decoding): every
    # token sampled in a step linked to the request
    assert len(steps) >= 2
    assert sum(s.attributes["llmbus.num_sampled"] for s in steps) >= 6


def _scrape(stack) -> str:
    response = httpx.get(f"{stack.base_url.removesuffix('/v1')}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_sample_belongs_to_a_declared_family(client, stack):
    """Each sample's family (its name, less a histogram's _bucket/_sum/_count) has HELP and
    TYPE lines under that very name, as Prometheus's text format requires."""
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)  # counters count
    text = _scrape(stack)
    assert "llmbus:request_success_total{" in text
    declared = {line.split()[2]: line.split()[3] for line in text.splitlines()
                if line.startswith("# TYPE ")}
    helped = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples
    for name in samples:
        family = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and declared.get(name.removesuffix(suffix)) == "histogram":
                family = name.removesuffix(suffix)
        assert family in declared and family in helped, name


def test_metrics_count_exactly_what_was_sent(client, stack):
    before = _scrape(stack)
    usages = []
    for i in range(3):
        reply = client.completions.create(model=MODEL_NAME, prompt=f"Count to {i + 3}:",
                                          max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
        usages.append(reply.usage)
    time.sleep(0.3)
    after = _scrape(stack)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("llmbus:generation_tokens_total") == 15
    assert delta("llmbus:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("llmbus:request_success_total", finished_reason="length") == 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):
        assert delta(f"llmbus:{histogram}_count") == 3, histogram
    assert delta("llmbus:inter_token_latency_seconds_count") == 3 * 4
    assert _value(after, "llmbus:num_requests_running") == 0
    assert _value(after, "llmbus:num_requests_waiting") == 0
    assert _value(after, "llmbus:kv_cache_usage_perc") == 0
    assert 'replica="engine0"' in after
    assert delta("llmbus:prefix_cache_queries_total") > 0


def test_a_stream_the_client_drops_counts_as_abort(stack):
    before = _value(_scrape(stack), "llmbus:request_success_total", finished_reason="abort")
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.base_url}/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                break  # the first token arrived: hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _value(_scrape(stack), "llmbus:request_success_total", finished_reason="abort")
        if after > before:
            break
        time.sleep(0.2)
    assert after == before + 1
    # a request refused at admission was never served: it is no abort
    refused = httpx.post(f"{stack.base_url}/completions", headers=AUTH, timeout=30, json={
        "model": MODEL_NAME, "prompt": "hello " * 9000})
    assert refused.status_code == 400
    assert _value(_scrape(stack), "llmbus:request_success_total", finished_reason="abort") \
        == after


def test_request_log_lines_carry_request_and_trace_ids(client, stack, otlp):
    reply = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=2,
        messages=[{"role": "user", "content": "Log me."}])
    root, _, _ = _trace_of(otlp, reply.id)
    lines = [line for line in stack.log().splitlines()
             if "request admitted" in line and reply.id in line]
    assert lines, "no log line for the request"
    assert re.search(rf"trace_id={root.trace_id}", lines[0])


def test_json_log_lines_have_every_field():
    buffer = io.StringIO()
    with redirect_stderr(buffer):
        log = configure_logging("api", "replica-1", fmt="json")
        log.info("hello", request_id="req-1")
    configure_logging("test", "t", fmt="console")
    record = json.loads(buffer.getvalue().strip().splitlines()[-1])
    assert record["event"] == "hello" and record["request_id"] == "req-1"
    assert record["service"] == "api" and record["replica"] == "replica-1"
    assert record["level"] == "info" and record["timestamp"]

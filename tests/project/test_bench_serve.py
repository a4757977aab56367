# Over 300 lines: the benchmark client's pure parts and one real run, kept with each other.
"""`llmbus bench`: the pure parts (statistics, arrivals, datasets, reports), the streaming client
against a mock transport, and one tiny run against the real test stack."""

from __future__ import annotations

import json
import math
import os
import random
import re

import httpx
import numpy as np
import pytest

from llmbus.bench.client import server_root, stream_request
from llmbus.bench.datasets import (
    BenchRequest,
    dialect_body,
    exact_text,
    jsonl_dataset,
    parse_jsonl_line,
    random_dataset,
    request_body,
    shared_prefix_dataset,
    single_token_words,
)
from llmbus.bench.metrics import RequestResult, format_report, percentile, summarize
from llmbus.bench.peers import process_tree, tree_memory_mib
from llmbus.bench.serve import Progress, RunConfig, arrival_delays, run_benchmark
from llmbus.bench.tables import render_all
from llmbus.services.model_files import default_model_path
from tests.stack import API_KEY, MODEL_NAME, needs_default_model


class WordTokenizer:
    """One token per space-separated word, except that `merge` pairs fuse into one token."""

    def __init__(self, merge: tuple[str, str] | None = None) -> None:
        self.merge = merge

    def encode(self, text: str) -> list[int]:
        words = text.split()
        ids: list[int] = []
        for i, word in enumerate(words):
            if self.merge and i and (words[i - 1], word) == self.merge and ids[-1] != -1:
                ids[-1] = -1  # fused with the previous word
                continue
            ids.append(len(word))
        return ids


@pytest.fixture(scope="module")
def gguf_tokenizer():
    if not default_model_path().is_file():
        pytest.skip("default model not pulled (`llmbus model pull`)")
    from llmbus.services.gguf_tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(default_model_path())


# --- statistics -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 5, 100, 1001])
def test_percentile_matches_numpy_linear(n):
    values = [random.Random(n).uniform(0, 50) for _ in range(n)]
    for p in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_arrivals_are_seeded_poisson():
    first = arrival_delays(2000, 4.0, seed=7)
    assert first == arrival_delays(2000, 4.0, seed=7)
    assert first != arrival_delays(2000, 4.0, seed=8)
    assert all(d >= 0 for d in first)
    assert sum(first) / len(first) == pytest.approx(1 / 4.0, rel=0.1)  # exponential, mean 1/rate
    assert arrival_delays(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_delays(3, 0.0)


# --- datasets ---------------------------------------------------------------------------------

def test_exact_text_trims_when_words_merge():
    tokenizer = WordTokenizer(merge=("a", "b"))
    rng = random.Random(0)
    for n in (1, 2, 17, 64):
        text = exact_text(tokenizer, ["a", "b"], n, rng)
        assert len(tokenizer.encode(text)) == n


@pytest.mark.model
def test_random_dataset_is_seeded_and_distinct(gguf_tokenizer):
    first = random_dataset(gguf_tokenizer, num_requests=6, input_len=64, seed=3)
    assert first == random_dataset(gguf_tokenizer, num_requests=6, input_len=64, seed=3)
    assert first != random_dataset(gguf_tokenizer, num_requests=6, input_len=64, seed=4)
    assert len({r.prompt for r in first}) == 6


@pytest.mark.model
@pytest.mark.parametrize("input_len", [1, 7, 256, 1000])
def test_random_prompts_have_exact_token_lengths(gguf_tokenizer, input_len):
    for request in random_dataset(gguf_tokenizer, num_requests=4, input_len=input_len):
        assert request.prompt_len == input_len
        assert len(gguf_tokenizer.encode(request.prompt)) == input_len


@pytest.mark.model
def test_shared_prefix_prompts(gguf_tokenizer):
    requests = shared_prefix_dataset(gguf_tokenizer, num_requests=5, prefix_len=300, input_len=20)
    assert len({r.system for r in requests}) == 1
    assert len({r.prompt for r in requests}) == 5
    assert len(gguf_tokenizer.encode(requests[0].system)) == 300
    for request in requests:
        full = request_body(request, chat=False, model="m", max_tokens=8, ignore_eos=False,
                            include_usage=False)["prompt"]
        assert len(gguf_tokenizer.encode(full)) == request.prompt_len == 320


def test_single_token_words_refuses_a_tokenizer_without_them():
    class ByteTokenizer:
        def encode(self, text: str) -> list[int]:
            return list(text.encode())

    with pytest.raises(ValueError, match="single-token words"):
        single_token_words(ByteTokenizer())


def test_jsonl_parsing(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "one two three"}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}\n'
                    '{"prompt": "four"}\n')
    requests = jsonl_dataset(path, tokenizer=WordTokenizer())
    assert requests == [
        BenchRequest(prompt="one two three", prompt_len=3),
        BenchRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5),
        BenchRequest(prompt="four", prompt_len=1)]
    assert len(jsonl_dataset(path, num_requests=2)) == 2
    assert jsonl_dataset(path)[0].prompt_len is None  # no tokenizer: unknown


@pytest.mark.parametrize("line", ['["x"]', '{"text": "x"}', '{"prompt": "x", "max_tokens": 0}',
                                  '{"messages": []}'])
def test_jsonl_rejects_bad_lines_with_their_number(tmp_path, line):
    with pytest.raises(ValueError):
        parse_jsonl_line(line)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2:"):
        jsonl_dataset(path)


def test_request_bodies():
    shared = BenchRequest(system="You are terse.", prompt=" Why?", prompt_len=5)
    chat = request_body(shared, chat=True, model="m", max_tokens=9, ignore_eos=True,
                        include_usage=True)
    assert chat["messages"] == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": " Why?"}]
    assert chat["stream"] and chat["ignore_eos"] and chat["max_tokens"] == 9
    assert chat["stream_options"] == {"include_usage": True}
    plain = request_body(shared, chat=False, model="m", max_tokens=9, ignore_eos=False,
                         include_usage=False)
    assert plain["prompt"] == "You are terse. Why?"
    assert "ignore_eos" not in plain and "stream_options" not in plain
    with pytest.raises(ValueError, match="--endpoint chat"):
        request_body(BenchRequest(messages=[{"role": "user", "content": "x"}]), chat=False,
                     model="m", max_tokens=1, ignore_eos=False, include_usage=False)
    responses = dialect_body(chat, "responses")
    assert responses["input"] == chat["messages"] and responses["max_output_tokens"] == 9
    messages = dialect_body(chat, "messages")
    assert messages["system"] == "You are terse." and messages["max_tokens"] == 9
    assert messages["messages"] == [{"role": "user", "content": " Why?"}]
    assert responses["ignore_eos"] and messages["ignore_eos"]
    assert "stream_options" not in responses and "stream_options" not in messages


@pytest.mark.parametrize("events", [
    [{"type": "response.output_text.delta", "delta": t} for t in (" a", " b", " c")]
    + [{"type": "response.completed", "response": {"usage": {"input_tokens": 4,
                                                            "output_tokens": 3}}}],
    [{"type": "content_block_delta", "delta": {"type": "text_delta", "text": t}}
     for t in (" a", " b", " c")]
    + [{"type": "message_delta", "usage": {"input_tokens": 4, "output_tokens": 3}}]])
async def test_stream_request_reads_the_responses_and_messages_events(events):
    transport = httpx.MockTransport(lambda r: httpx.Response(
        200, content=_sse(events), headers={"content-type": "text/event-stream"}))
    async with httpx.AsyncClient(transport=transport) as client:
        result = await stream_request(client, "http://x/v1/responses", {}, headers={})
    assert result.ok and result.output_text == " a b c"
    assert result.output_tokens == 3 and result.usage_counted and result.prompt_len == 4


# --- reports ----------------------------------------------------------------------------------

def test_report_fields_and_math():
    results = [
        RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                      itl=[0.1] * 4, usage_counted=True),
        RequestResult(ok=True, prompt_len=10, output_tokens=3, ttft=0.3, latency=0.5,
                      itl=[0.1, 0.1], usage_counted=True),
        RequestResult(ok=False, error="HTTP 500: boom"),
    ]
    report = summarize(results, duration=2.0, config={"model": "m"})
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["errors"] == ["HTTP 500: boom"]
    assert report["total_input_tokens"] == 20 and report["total_output_tokens"] == 8
    assert report["request_throughput"] == 1.0 and report["output_throughput"] == 4.0
    assert report["output_tokens_counted_by"] == "usage"
    assert report["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert report["tpot_ms"]["p50"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (0.5-0.3)/2
    assert report["itl_ms"]["p99"] == pytest.approx(100.0)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99", "p99.9", "max"}
    table = format_report(report)
    assert re.search(r"Output token throughput \(tok/s\)\s+4\.00", table)
    assert "error: HTTP 500: boom" in table


def test_report_of_a_run_where_everything_failed_is_valid_json():
    report = summarize([RequestResult(error="x")], duration=1.0)
    assert report["completed"] == 0 and report["ttft_ms"]["p50"] is None
    json.dumps(report, allow_nan=False)
    assert "-" in format_report(report)


def test_progress_bar_text():
    class Sink:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return False

    sink = Sink()
    progress = Progress(4, stream=sink, width=8)
    for ok in (True, False, True, True):
        progress.update(ok)
    assert "[########] 4/4 requests, 1 failed" in sink.text


def test_compare_tables_give_peer_over_llmbus_ratios():
    def report(tput, ttft, itl):
        return {"output_throughput": tput, "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl},
                "tpot_ms": {"p50": itl}, "failed": 0}

    name = "random 8/4 c1"
    summary = {
        "workloads": [{"name": name, "dataset": "random", "concurrency": 1, "input_len": 8}],
        "servers": {
            "llmbus": {"version": "0.1", "threads": 2, "dtype": "float32",
                       "workloads": {name: report(10.0, 100.0, 20.0)}},
            "llama-cpp": {"version": "b1", "threads": 2, "dtype": "Q4_1",
                          "workloads": {name: report(30.0, 50.0, 10.0)}},
            "hf": {"transformers": "5", "torch": "2", "threads": 2, "dtype": "float32",
                   "runs": [{"batch_size": 1, "input_len": 8, "output_throughput": 5.0,
                             "prefill_ms": 200.0, "decode_step_ms": 40.0}]}},
        "skipped": {"vllm-cpu": "not installed"}}
    text = render_all(summary)
    assert f"| {name} | llama-cpp | 3.00× | 0.50× | 0.50× |" in text
    assert f"| {name} | hf | 0.50× | 2.00× | 2.00× |" in text
    assert "skipped vllm-cpu: not installed" in text
    assert "the stack's share" not in text  # no in-process run: no table of it
    summary["servers"]["llmbus-inprocess"] = {
        "version": "executor only", "threads": 2, "dtype": "int8",
        "workloads": {name: {"output_throughput": 12.5, "ttft_ms_p50": 80.0,
                             "tpot_ms_p50": 16.0}}}
    text = render_all(summary)
    assert f"| {name} | 10.0 | 12.5 | 0.80× |" in text  # llmbus / the executor alone
    assert f"| {name} | llmbus-inprocess | 1.25× | 0.80× | 0.80× |" in text


# --- client and run loop against a mock server -----------------------------------------------

def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) \
        + b"data: [DONE]\n\n"


def _mock_server(*, usage: bool, reject_stream_options: bool = False):
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if reject_stream_options and "stream_options" in body:
            return httpx.Response(400, json={"error": {"message": "unknown stream_options"}})
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in (" a", " b", " c")]
        if usage and body.get("stream_options", {}).get("include_usage"):
            chunks.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
        return httpx.Response(200, content=_sse(chunks),
                              headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler), seen


async def test_stream_request_times_chunks_and_reads_usage():
    transport, _ = _mock_server(usage=True)
    async with httpx.AsyncClient(transport=transport) as client:
        result = await stream_request(client, "http://x/v1/completions",
                                      {"stream_options": {"include_usage": True}}, headers={})
    assert result.ok and result.output_text == " a b c"
    assert result.output_tokens == 3 and result.usage_counted and result.prompt_len == 4
    assert len(result.itl) == 2 and 0 < result.ttft <= result.latency


async def test_stream_request_reports_http_errors():
    transport = httpx.MockTransport(lambda r: httpx.Response(503, text="down"))
    async with httpx.AsyncClient(transport=transport) as client:
        result = await stream_request(client, "http://x/v1/completions", {}, headers={})
    assert not result.ok and result.error == "HTTP 503: down"


async def test_run_falls_back_to_tokenizer_counts_without_stream_options():
    transport, seen = _mock_server(usage=False, reject_stream_options=True)
    requests = [BenchRequest(prompt=f" q{i}", prompt_len=1) for i in range(5)]
    config = RunConfig(base_url="http://x/v1", model="m", max_concurrency=2, progress=False)
    results, duration, usage = await run_benchmark(
        requests, config, count_tokens=lambda text: len(text.split()), transport=transport)
    assert not usage and duration > 0
    assert [r.output_tokens for r in results] == [3] * 5
    assert all(r.ok and not r.usage_counted for r in results)
    assert "stream_options" not in seen[-1]


def test_server_root():
    assert server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://h:1") == "http://h:1"


def test_process_tree_memory_of_this_process():
    assert process_tree(os.getpid())[0] == os.getpid()
    rss, pss = tree_memory_mib(os.getpid())
    assert rss > 10 and pss > 0


# --- against the real stack -------------------------------------------------------------------

@pytest.mark.model
@needs_default_model()
def test_bench_serve_against_the_stack(stack, tmp_path, capsys):
    from llmbus.bench.cli import build_parser, run_serve

    result_json = tmp_path / "report.json"
    args = build_parser().parse_args([
        "serve", "--base-url", stack.base_url, "--api-key", API_KEY, "--num-requests", "4",
        "--input-len", "16", "--max-tokens", "8", "--ignore-eos", "--max-concurrency", "2",
        "--result-json", str(result_json), "--no-progress"])
    report = run_serve(args)
    assert report == json.loads(result_json.read_text())
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 32 and report["output_tokens_counted_by"] == "usage"
    assert report["total_input_tokens"] == 64
    assert report["config"]["model"] == MODEL_NAME
    assert report["ttft_ms"]["p50"] > 0 and report["itl_ms"]["p50"] > 0
    assert "Output token throughput" in capsys.readouterr().out


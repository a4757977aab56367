"""Disaggregated serving against mixed engines, with equal resources, in one run.

Three stacks, one after the other, each engine pinned to a core of its own (`taskset`; the api,
tokenizer and detokenizer share every core), the default model in the fast mode:

- `mixed`: two mixed engines, cache-aware routing;
- `disaggregated`: one prefill engine and one decode engine, every prompt prefilled remotely
  (`--disaggregation always`);
- `conditional`: the same two, the decode engine deciding per request (`auto`, the default).

The load: Poisson arrivals of short requests (about 256 tokens in, 128 out) mixed with 15%
long ones (about 3,000 in, 32 out), the same for each stack (seeded). Per class it reports TTFT
p50/p99, ITL p50/p99/p99.9, the longest stall and the output throughput, and the goodput: short
requests a second whose TTFT was at most 2 s and whose own ITL p99 at most 100 ms.

`--check-equal N` instead serves N prompts of 50 to 3,000 tokens greedily in the exact mode on
a mixed stack and on a disaggregated one and says whether every answer is the same.

    python -m llmbus.bench.disaggregation [--rate 0.6] [--num-requests 60] [--json FILE]
    python -m llmbus.bench.disaggregation --check-equal 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from llmbus.bench.datasets import BenchRequest, exact_text, single_token_words
from llmbus.bench.metrics import RequestResult, percentile
from llmbus.bench.serve import RunConfig, run_benchmark
from llmbus.bench.stack import MODEL_NAME, engine_stats
from llmbus.services.launcher import Stack, _start_services, free_port, wait_until_ready

SHORT = (256, 128)  # tokens in, out
LONG = (3000, 32)
LONG_FRACTION = 0.15
SLO_TTFT_S, SLO_ITL_P99_S = 2.0, 0.100
STACKS = {  # engine id -> (role, scheduler options)
    "mixed": {"engine0": ("mixed", []), "engine1": ("mixed", [])},
    "disaggregated": {"prefill0": ("prefill", []),
                      "decode0": ("decode", ["--disaggregation", "always"])},
    "conditional": {"prefill0": ("prefill", []), "decode0": ("decode", [])},
}


def start(kind: str, executor_options: Sequence[str], cpus: int) -> tuple[Stack, str, str]:
    """A stack of `kind`, each engine on its own core; returns (stack, base URL, observer)."""
    stack = Stack()
    port = free_port()
    url = stack.start_nats()
    copies = _start_services(stack, url, {"api": ["--port", str(port)]},
                             {"api": 1, "tokenizer": 1, "detokenizer": 1, "engine": 0})
    for index, (engine_id, (role, options)) in enumerate(STACKS[kind].items()):
        core = str(index % cpus)
        common = ["--nats-url", url, "--engine-id", engine_id]
        stack.start_service("executor", [*common, "--threads", "1", *executor_options],
                            f"executor.{engine_id}", cpus=core)
        stack.start_service("scheduler", [*common, "--role", role, *options],
                            f"scheduler.{engine_id}", cpus=core)
    health = f"http://127.0.0.1:{port}/health"
    dead = wait_until_ready(stack, health, 600, copies | {"scheduler": 2, "executor": 2})
    if dead is not None:
        stack.stop()
        raise SystemExit(f"{dead.name} died while {kind} started:\n" + "\n".join(dead.tail))
    if kind != "mixed":  # the decode engine hears of the prefill engine by its heartbeats
        deadline = time.monotonic() + 30
        while not asyncio.run(engine_stats(stack.observer_url(url), "decode0")
                              ).num_prefill_engines:
            if time.monotonic() > deadline:
                raise SystemExit("the decode engine never heard of the prefill engine")
            time.sleep(0.2)
    return stack, f"http://127.0.0.1:{port}/v1", stack.observer_url(url)


def workload(num_requests: int, seed: int) -> tuple[list[BenchRequest], list[str]]:
    """The requests, and each one's class ("short" or "long"), the same for a given seed."""
    from llmbus.services.gguf_tokenizer import GGUFTokenizer
    from llmbus.services.model_files import resolve_model

    tokenizer = GGUFTokenizer.from_gguf(resolve_model(None))
    words = single_token_words(tokenizer)
    rng = random.Random(seed)
    requests, classes = [], []
    for _ in range(num_requests):
        kind = "long" if rng.random() < LONG_FRACTION else "short"
        tokens_in, tokens_out = LONG if kind == "long" else SHORT
        requests.append(BenchRequest(prompt=exact_text(tokenizer, words, tokens_in, rng),
                                     prompt_len=tokens_in, max_tokens=tokens_out))
        classes.append(kind)
    return requests, classes


def class_report(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    itl = [gap for r in done for gap in r.itl]

    def ms(values: list[float], p: float) -> float | None:
        return percentile(values, p) * 1000 if values else None

    return {"requests": len(results), "failed": len(results) - len(done),
            "ttft_p50_ms": ms([r.ttft for r in done], 50),
            "ttft_p99_ms": ms([r.ttft for r in done], 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99), "itl_p999_ms": ms(itl, 99.9),
            "longest_stall_ms": max(itl) * 1000 if itl else None,
            "output_tok_s": sum(r.output_tokens for r in done) / duration}


def meets_slo(result: RequestResult) -> bool:
    return (result.ok and result.ttft <= SLO_TTFT_S
            and (not result.itl or percentile(result.itl, 99) <= SLO_ITL_P99_S))


def run_load(kind: str, requests: list[BenchRequest], classes: list[str], rate: float,
             seed: int, cpus: int) -> dict[str, Any]:
    stack, base_url, observer = start(kind, [], cpus)
    try:
        config = RunConfig(base_url=base_url, model=MODEL_NAME, request_rate=rate,
                           ignore_eos=True, seed=seed, max_tokens=SHORT[1])
        results, duration, _ = asyncio.run(run_benchmark(requests, config))
        engines = {e: asyncio.run(engine_stats(observer, e)) for e in STACKS[kind]}
    finally:
        stack.stop()
    by_class = {c: [r for r, k in zip(results, classes, strict=True) if k == c]
                for c in ("short", "long")}
    report = {"stack": kind, "duration_s": duration,
              "output_tok_s": sum(r.output_tokens for r in results if r.ok) / duration,
              "goodput_req_s": sum(map(meets_slo, by_class["short"])) / duration,
              **{c: class_report(rs, duration) for c, rs in by_class.items()}}
    remote = sum(s.num_remote_prefills for s in engines.values())
    kv_bytes = sum(s.kv_bytes_received for s in engines.values())
    kv_seconds = sum(s.kv_transfer_seconds for s in engines.values())
    report["remote_prefills"] = remote
    report["kv_mb_s"] = kv_bytes / 1e6 / kv_seconds if kv_seconds else None
    report["kv_wait_ms"] = (sum(s.kv_wait_seconds for s in engines.values()) * 1000 / remote
                            if remote else None)
    return report


def print_table(reports: list[dict[str, Any]]) -> None:
    def f(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    print("| stack | class | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
          "ITL p99.9 ms | longest stall ms | output tok/s | failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for report in reports:
        for kind in ("short", "long"):
            c = report[kind]
            print(f"| {report['stack']} | {kind} ({c['requests']}) | {f(c['ttft_p50_ms'])} | "
                  f"{f(c['ttft_p99_ms'])} | {f(c['itl_p50_ms'], 1)} | {f(c['itl_p99_ms'], 1)} | "
                  f"{f(c['itl_p999_ms'], 1)} | {f(c['longest_stall_ms'])} | "
                  f"{f(c['output_tok_s'], 1)} | {c['failed']} |")
    print()
    print("| stack | output tok/s (all) | goodput req/s (short, TTFT <= 2 s, ITL p99 <= "
          "100 ms) | prompts prefilled remotely | KV MB/s while in flight | KV wait after "
          "the last forward, ms a prompt |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in reports:
        print(f"| {r['stack']} | {f(r['output_tok_s'], 1)} | {f(r['goodput_req_s'], 3)} | "
              f"{r['remote_prefills']} | {f(r['kv_mb_s'])} | {f(r['kv_wait_ms'], 1)} |")


async def _greedy(base_url: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(timeout=600) as http:
        answers = []
        for prompt in prompts:
            response = await http.post(f"{base_url}/completions", json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
            response.raise_for_status()
            answers.append(response.json()["choices"][0]["text"])
            print(".", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        return answers


def check_equal(num_prompts: int, cpus: int, seed: int) -> bool:
    from llmbus.services.gguf_tokenizer import GGUFTokenizer
    from llmbus.services.model_files import resolve_model

    tokenizer = GGUFTokenizer.from_gguf(resolve_model(None))
    words = single_token_words(tokenizer)
    rng = random.Random(seed)
    lengths = [round(50 * (3000 / 50) ** (i / max(num_prompts - 1, 1)))
               for i in range(num_prompts)]  # 50 to 3,000, evenly on a log scale
    prompts = [exact_text(tokenizer, words, n, rng) for n in lengths]
    answers = {}
    for kind in ("mixed", "disaggregated"):
        stack, base_url, observer = start(kind, ["--exact"], cpus)
        try:
            started = time.perf_counter()
            answers[kind] = asyncio.run(_greedy(base_url, prompts, 32))
            remote = sum(asyncio.run(engine_stats(observer, e)).num_remote_prefills
                         for e in STACKS[kind])
            print(f"{kind}: {len(prompts)} prompts in {time.perf_counter() - started:.0f} s, "
                  f"{remote} prefilled remotely", file=sys.stderr)
        finally:
            stack.stop()
    same = [a == b for a, b in zip(answers["mixed"], answers["disaggregated"], strict=True)]
    print(f"prompt lengths {lengths[0]}..{lengths[-1]} tokens, 32 greedy tokens each, exact "
          f"mode: {sum(same)} of {len(same)} answers equal")
    for n, ok in zip(lengths, same, strict=True):
        if not ok:
            print(f"  differs: the {n}-token prompt")
    return all(same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=0.6, help="requests a second")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the reports here")
    parser.add_argument("--check-equal", type=int, default=0, metavar="N",
                        help="instead: N greedy prompts of 50..3000 tokens, mixed against "
                             "disaggregated, exact mode")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    if args.check_equal:
        sys.exit(0 if check_equal(args.check_equal, cpus, args.seed) else 1)
    requests, classes = workload(args.num_requests, args.seed)
    print(f"{len(requests)} requests ({classes.count('long')} long) at {args.rate}/s, "
          f"{cpus} cores, an engine per core", file=sys.stderr)
    reports = []
    for kind in args.stacks.split(","):
        print(f"--- {kind}", file=sys.stderr)
        reports.append(run_load(kind, requests, classes, args.rate, args.seed, cpus))
    print_table(reports)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)


if __name__ == "__main__":
    main()

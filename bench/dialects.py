"""What an API dialect costs: one chat load through `/v1/chat/completions`, OpenAI's Responses
API and Anthropic's Messages API, in one run on one stack, rounds alternating so that drift
(a warming cache, a busy neighbour) falls on every dialect alike.

Each dialect is a translation onto the chat path, so its output tok/s should be the chat's;
target: within 5% at 16 concurrent streams. Starts `llmbus up` on the default model unless
--base-url names a running server.

    python -m llmbus.bench.dialects [--requests 48] [--concurrency 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from llmbus.bench.client import ServerTokenizer
from llmbus.bench.datasets import random_dataset
from llmbus.bench.serve import RunConfig, bench_report, fetch_model_name
from llmbus.bench.stack import start_stack, stop_stack

DIALECTS = ("chat", "responses", "messages")


def measure(base_url: str, api_key: str | None,
            args: argparse.Namespace) -> dict[str, list[float]]:
    """Output tok/s per dialect, one number per round. Every run has prompts of its own (the
    same lengths), so no run finds another's in the prefix cache; a first, unmeasured run
    warms the stack up."""
    model = asyncio.run(fetch_model_name(base_url, api_key))
    tokenizer = ServerTokenizer(base_url, model, api_key)
    rates: dict[str, list[float]] = {d: [] for d in DIALECTS}
    runs = [("warm-up", "chat")] + [
        (f"round {r + 1}", dialect) for r in range(args.rounds)
        for dialect in (DIALECTS if r % 2 == 0 else DIALECTS[::-1])]
    for seed, (label, dialect) in enumerate(runs):
        requests = random_dataset(tokenizer, num_requests=args.requests,
                                  input_len=args.input_len, seed=seed)
        report = bench_report(requests, RunConfig(
            base_url=base_url, model=model, endpoint=dialect, api_key=api_key,
            max_concurrency=args.concurrency, max_tokens=args.max_tokens, ignore_eos=True,
            progress=False))
        if report["failed"]:
            raise SystemExit(f"{dialect}: {report['failed']} requests failed: "
                             f"{report['errors']}")
        if label != "warm-up":
            rates[dialect].append(report["output_throughput"])
        print(f"{label:<8} {dialect:<10} {report['output_throughput']:8.1f} output tok/s  "
              f"ITL p50 {report['itl_ms']['p50']:.1f} ms", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None,
                        help="a running server's /v1 URL (default: start `llmbus up`)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=48, help="per dialect and round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.base_url:
        rates = measure(args.base_url, args.api_key, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            stack = start_stack(Path(tmp))
            try:
                rates = measure(stack.base_url, None, args)
            finally:
                stop_stack(stack)
    chat = statistics.mean(rates["chat"])
    print(f"\n{'dialect':<10} {'output tok/s':>12} {'vs chat':>8}  (mean of {args.rounds} "
          f"rounds, {args.requests} requests at {args.concurrency} concurrent, "
          f"{args.input_len} in / {args.max_tokens} out)")
    for dialect in DIALECTS:
        mean = statistics.mean(rates[dialect])
        print(f"{dialect:<10} {mean:12.1f} {mean / chat:8.3f}")
    print("target: each dialect within 5% of chat (0.95 or more)")


if __name__ == "__main__":
    main()

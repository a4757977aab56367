"""`llmbus bench serve` (one server under load) and `llmbus bench compare` (llmbus vs peers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from llmbus.bench.datasets import (
    BenchRequest,
    Tokenizer,
    jsonl_dataset,
    random_dataset,
    shared_prefix_dataset,
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the server's OpenAI base URL (default: %(default)s)")
    server.add_argument("--endpoint", choices=("completions", "chat", "responses", "messages"),
                        default="completions",
                        help="/v1/completions, /v1/chat/completions, or the same chat through "
                             "the Responses or the Anthropic Messages API (default: "
                             "%(default)s)")
    server.add_argument("--model", default=None,
                        help="model name to send (default: the first in /v1/models)")
    server.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    data = parser.add_argument_group("workload")
    data.add_argument("--dataset", choices=("random", "shared-prefix", "jsonl"),
                      default="random", help="prompt source (default: %(default)s)")
    data.add_argument("--input-len", type=int, default=256,
                      help="prompt tokens (random), question tokens (shared-prefix)")
    data.add_argument("--prefix-len", type=int, default=1024,
                      help="tokens of the shared system text (shared-prefix)")
    data.add_argument("--dataset-path", default=None,
                      help='JSONL file, one {"prompt": ...} or {"messages": [...]} per line')
    data.add_argument("--num-requests", type=int, default=64)
    data.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    data.add_argument("--ignore-eos", action="store_true",
                      help="ask the server to go on past EOS (vLLM/llama.cpp `ignore_eos`)")
    data.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    data.add_argument("--json-schema", default=None, metavar="FILE",
                      help="constrain every request's output to the JSON schema in FILE "
                           "(structured output: compare with the same run without it)")
    data.add_argument("--tokenizer", choices=("gguf", "server"), default="gguf",
                      help="measure prompt lengths with the GGUF's tokenizer (exact, local) or "
                      "the server's /tokenize (default: %(default)s)")
    data.add_argument("--tokenizer-gguf", default=None,
                      help="GGUF whose tokenizer to use (default: the default model)")
    load = parser.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="requests in flight at most (default: no limit)")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="mean requests per second, Poisson arrivals (default: inf, all at "
                      "once)")
    load.add_argument("--num-warmups", type=int, default=1, help="untimed requests first")
    parser.add_argument("--result-json", default=None, help="also write the report here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def load_tokenizer(args: argparse.Namespace, model: str | None) -> Tokenizer:
    if args.tokenizer == "server":
        from llmbus.bench.client import ServerTokenizer

        return ServerTokenizer(args.base_url, model, args.api_key)
    from llmbus.services.gguf_tokenizer import GGUFTokenizer
    from llmbus.services.model_files import default_model_path

    path = Path(args.tokenizer_gguf) if args.tokenizer_gguf else default_model_path()
    if not path.is_file():
        raise SystemExit(f"no GGUF at {path}: pass --tokenizer-gguf, run `llmbus model pull`, "
                         "or use --tokenizer server")
    return GGUFTokenizer.from_gguf(path)


def load_json_schema(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--json-schema {path}: {exc}") from None
    if not isinstance(schema, dict):
        raise SystemExit(f"--json-schema {path}: not a JSON schema object")
    return schema


def build_dataset(args: argparse.Namespace, tokenizer: Tokenizer) -> list[BenchRequest]:
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise SystemExit("--dataset jsonl needs --dataset-path")
        return jsonl_dataset(args.dataset_path, num_requests=args.num_requests,
                             tokenizer=tokenizer)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(tokenizer, num_requests=args.num_requests,
                                     prefix_len=args.prefix_len, input_len=args.input_len,
                                     seed=args.seed)
    return random_dataset(tokenizer, num_requests=args.num_requests, input_len=args.input_len,
                          seed=args.seed)


def run_serve(args: argparse.Namespace) -> dict:
    """Run `bench serve` from parsed options; returns the report (also printed and saved)."""
    from llmbus.bench.metrics import format_report
    from llmbus.bench.serve import RunConfig, bench_report, fetch_model_name

    model = args.model or asyncio.run(fetch_model_name(args.base_url, args.api_key))
    tokenizer = load_tokenizer(args, model)
    requests = build_dataset(args, tokenizer)
    config = RunConfig(base_url=args.base_url, model=model, endpoint=args.endpoint,
                       api_key=args.api_key, max_concurrency=args.max_concurrency,
                       request_rate=args.request_rate, max_tokens=args.max_tokens,
                       ignore_eos=args.ignore_eos, seed=args.seed,
                       num_warmups=args.num_warmups, progress=not args.no_progress,
                       json_schema=load_json_schema(args.json_schema))
    extra = {"dataset": args.dataset, "num_requests": len(requests),
             "input_len": args.input_len if args.dataset != "jsonl" else None,
             "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else None,
             "tokenizer": args.tokenizer}
    report = bench_report(requests, config, lambda text: len(tokenizer.encode(text)), extra)
    print(format_report(report))
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmbus bench",
                                     description="Benchmark OpenAI-compatible servers.")
    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="load one server (llmbus or a peer) with streaming requests",
        description="Stream a workload to an OpenAI-compatible server and report throughput, "
        "TTFT, TPOT and inter-token latency.")
    add_serve_arguments(serve)
    compare = commands.add_parser(
        "compare", help="llmbus vs llama.cpp / vLLM / HF transformers on the same GGUF",
        description="Start llmbus and each installed peer one at a time, run the same "
        "workloads, print a table of ratios.")
    from llmbus.bench.compare import add_compare_arguments

    add_compare_arguments(compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bench_command == "compare":
        from llmbus.bench.compare import run_compare

        return run_compare(args)
    report = run_serve(args)
    return 0 if report["completed"] and not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())

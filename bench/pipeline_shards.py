"""A model split by layers against the same model whole, in one run (issue 42's table).

Three stacks, one at a time, on the same file, each executor process pinned to its cores
(`taskset -a`: every thread it has and will have):
- whole, 1 core: one executor, `--threads 1`, on core 0;
- 2 shards, a core each: `--pipeline-shards 2`, the lead on core 0, the layer shard on core 1,
  `--threads 1` each;
- whole, 2 cores: one executor, `--threads 2`, on cores 0-1.
Each serves one stream (time per output token) and then 8 concurrent streams (output tok/s);
the table gives the shards' ratios against the whole engine on as many cores as one shard
(one stream) and on as many as both (8 streams), each executor's weight and KV bytes from its
plan line, its PSS after serving, and the bytes a decode token sends between shards.

On a shared host the three stacks' speeds move from minute to minute (the whole engine's 8
streams from 15.1 to 19.8 tok/s between runs of 2026-12-04), so `--rounds N` starts the three
in turn N times: each ratio is taken within a round (stacks minutes apart), and the verdict is
the median of the rounds'.

    python -m llmbus.bench.pipeline_shards --model FILE.gguf [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmbus.bench.client import ServerTokenizer, stream_request
from llmbus.bench.datasets import random_dataset, request_body
from llmbus.bench.metrics import summarize
from llmbus.bench.peers import tree_memory_mib
from llmbus.bench.stack import start_stack, stop_stack
from llmbus.services.model_files import model_name_for

CONFIGS = {  # name: (up options, cores of each executor process, lead first)
    "whole, 1 core": (["--threads", "1"], ["0"]),
    "2 shards, a core each": (["--threads", "1", "--pipeline-shards", "2"], ["0", "1"]),
    "whole, 2 cores": (["--threads", "2"], ["0-1"]),
}
PLAN_LINE = re.compile(r"executor shard (\d)/\d: .*?(\d+) MiB of weights, (\d+) MiB of KV")
WHOLE_LINE = re.compile(r"model loaded .*?kv_mib=(\d+) .*?weight_mib=(\d+)")


def executor_pids(up_pid: int) -> list[int]:
    """The stack's executor processes, the lead (or the whole one) first, then by shard."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == up_pid and b"executor" in argv and b"serve" in argv:
            shard = argv[argv.index(b"--shard") + 1].decode() if b"--shard" in argv else "0/1"
            found.append((int(shard.split("/")[0]), int(proc.name)))
    return [pid for _, pid in sorted(found)]


async def _load(base_url: str, model: str, requests, concurrency: int,
                max_tokens: int) -> dict:
    url = f"{base_url}/completions"
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(request):
            async with gate:
                body = request_body(request, chat=False, model=model,
                                    max_tokens=max_tokens, ignore_eos=True, include_usage=True)
                return await stream_request(client, url, body, headers={},
                                            prompt_len=request.prompt_len)
        started = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
    return summarize(results, time.perf_counter() - started)


def run_config(name: str, args: argparse.Namespace, work_dir: Path) -> dict:
    options, cores = CONFIGS[name]
    stack = start_stack(work_dir, "--model", str(args.model), "--num-blocks",
                        str(args.num_blocks), *options, timeout=600)
    try:
        pids = executor_pids(stack.process.pid)
        assert len(pids) == len(cores), f"{name}: executors {pids}, cores {cores}"
        for pid, core in zip(pids, cores, strict=True):
            subprocess.run(["taskset", "-a", "-cp", core, str(pid)], check=True,
                           stdout=subprocess.DEVNULL)
        model = model_name_for(args.model)
        tokenizer = ServerTokenizer(stack.base_url, model)
        one = random_dataset(tokenizer, num_requests=args.c1_requests, input_len=64, seed=1)
        many = random_dataset(tokenizer, num_requests=args.requests,
                              input_len=args.input_len, seed=2)
        tokenizer.close()
        asyncio.run(_load(stack.base_url, model, one[:1], 1, 8))  # warm-up
        single = asyncio.run(_load(stack.base_url, model, one, 1, args.c1_tokens))
        batch = asyncio.run(_load(stack.base_url, model, many, args.concurrency,
                                  args.max_tokens))
        memory = [tree_memory_mib(pid)[1] for pid in pids]
        log = stack.log_path.read_text(errors="replace")
        plans = {int(m[1]): (int(m[2]), int(m[3])) for m in PLAN_LINE.finditer(log)}
        if len(cores) == 1:  # the whole model: its file, its cache
            plans = {0: next((int(m[2]), int(m[1])) for m in WHOLE_LINE.finditer(log))}
    finally:
        stop_stack(stack)
    return {"tpot_ms": single["tpot_ms"]["p50"], "tok_s": batch["output_throughput"],
            "failed": single["failed"] + batch["failed"], "pss_mib": memory, "plans": plans}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the GGUF to serve")
    parser.add_argument("--c1-requests", type=int, default=4)
    parser.add_argument("--c1-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=1024,
                        help="KV blocks of every engine, so that each holds as many tokens "
                             "(default: 1024)")
    parser.add_argument("--only", choices=list(CONFIGS), default=None,
                        help="run this stack alone (to repeat one row; no ratios)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="start the stacks in turn this many times; ratios are the median "
                             "of the rounds' (default: 1)")
    args = parser.parse_args(argv)
    from llmbus.services.executor.weights.model_config import read_config
    from llmbus.services.gguf_metadata import read_metadata, read_tensor_infos

    infos = read_tensor_infos(args.model)
    config = read_config(read_metadata(args.model), {n: i.shape for n, i in infos.items()})
    names = [args.only] if args.only else list(CONFIGS)
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as work_dir:
        for number in range(args.rounds):
            for name in names:
                print(f"# round {number + 1}/{args.rounds}: {name} ...", file=sys.stderr,
                      flush=True)
                rounds[name].append(run_config(name, args, Path(work_dir)))
    print(f"model {args.model.name}: {config.num_layers} layers, hidden {config.hidden_size}; "
          f"a decode token sends {config.hidden_size * 4} bytes to the layer shard and as many "
          "back (float32 hidden states)")
    print("| executor | 1 stream TPOT p50 ms | 8 streams output tok/s | PSS MiB | "
          "weights / KV MiB (plan line) |")
    print("|---|---:|---:|---:|---:|")
    for name, results in rounds.items():
        last = results[-1]
        plans = "; ".join(f"{w} / {k}" for _, (w, k) in sorted(last["plans"].items())) or "-"
        pss = " + ".join(f"{p:.0f}" for p in last["pss_mib"])
        print(f"| {name} | {_median_of(results, 'tpot_ms')} | {_median_of(results, 'tok_s')} "
              f"| {pss} | {plans} |")
    failed = sum(r["failed"] for results in rounds.values() for r in results)
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
    if args.only:
        return 1 if failed else 0
    one_core, shards, two_cores = (rounds[n] for n in CONFIGS)
    single = [s["tpot_ms"] / o["tpot_ms"] for s, o in zip(shards, one_core, strict=True)]
    batch = [s["tok_s"] / t["tok_s"] for s, t in zip(shards, two_cores, strict=True)]
    print(f"\nshards / whole on 1 core, 1 stream TPOT: {_verdict(single)} (target <= 1.15)\n"
          f"shards / whole on 2 cores, 8 streams tok/s: {_verdict(batch)} (target >= 0.85)")
    return 1 if failed else 0


def _median_of(results: list[dict], key: str) -> str:
    """The rounds' median of `key`, and each round's value where there are several."""
    values = [r[key] for r in results]
    each = f" ({', '.join(f'{v:.1f}' for v in values)})" if len(values) > 1 else ""
    return f"{statistics.median(values):.1f}{each}"


def _verdict(ratios: list[float]) -> str:
    """The median ratio, and each round's where there are several."""
    each = f" (rounds: {', '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{each}"


if __name__ == "__main__":
    sys.exit(main())

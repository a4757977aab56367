"""The executor alone, driven in-process, one request at a time: the floor under the stack.

`bench compare` sets this beside the whole stack at concurrency 1 (same model, options,
threads and prompts) to show what the bus, scheduler, api and detokenizer add per token.
Each request is one prefill step and then one decode step per token (greedy, EOS ignored),
as the scheduler plans a lone request:

    python -m llmbus.bench.inprocess --num-requests 8 --input-len 256 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def run_request(runner, sequence_id: str, prompt: list[int], max_tokens: int,
                step_id: int) -> tuple[float, list[float], int]:
    """(prefill seconds, seconds between consecutive tokens, next step id)."""
    from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan

    block_size = runner.block_size
    num_blocks = -(-(len(prompt) + max_tokens) // block_size)
    blocks = list(range(1, num_blocks + 1))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    result = runner.step(StepPlan(
        step_id=step_id, new_requests=[NewRequestData(sequence_id, list(prompt), params)],
        scheduled=[ScheduledRequest(sequence_id, 0, len(prompt), blocks)]))
    if result.error:
        raise RuntimeError(result.error)
    prefill = time.perf_counter() - start
    gaps, last = [], time.perf_counter()
    for i in range(max_tokens - 1):
        step_id += 1
        result = runner.step(StepPlan(step_id=step_id, scheduled=[
            ScheduledRequest(sequence_id, len(prompt) + i, 1)]))
        if result.error:
            raise RuntimeError(result.error)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    runner.step(StepPlan(step_id=step_id + 1, finished_sequence_ids=[sequence_id]))
    return prefill, gaps, step_id + 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF model (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--exact", action="store_true", help="the executor's exact mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv)

    from llmbus.services.executor.kernels.cpu.library import configure_openmp

    configure_openmp()  # as the executor service does, before torch loads
    from llmbus.bench.datasets import random_dataset
    from llmbus.services.executor.runner import ModelRunner
    from llmbus.services.gguf_tokenizer import GGUFTokenizer
    from llmbus.services.model_files import default_model_path, model_name_for

    path = Path(args.gguf) if args.gguf else default_model_path()
    tokenizer = GGUFTokenizer.from_gguf(path)
    runner = ModelRunner(path, model_name=model_name_for(path), num_threads=args.threads,
                         num_blocks=-(-(args.input_len + args.max_tokens) // 16) + 2,
                         backend="auto", exact=args.exact)
    dataset = random_dataset(tokenizer, num_requests=args.num_requests + 1,
                             input_len=args.input_len, seed=args.seed)
    prompts = [tokenizer.encode(r.prompt or "") for r in dataset]
    step_id = run_request(runner, "warmup", prompts[0], 8, 0)[2]
    prefills, tpots, started = [], [], time.perf_counter()
    for i, prompt in enumerate(prompts[1:]):
        prefill, gaps, step_id = run_request(runner, f"r{i}", prompt, args.max_tokens, step_id)
        prefills.append(prefill * 1000)
        tpots.append(statistics.fmean(gaps) * 1000)
    duration = time.perf_counter() - started
    result = {"precision": "exact" if args.exact else "fast", "threads": runner.num_threads,
              "num_requests": args.num_requests, "input_len": args.input_len,
              "max_tokens": args.max_tokens,
              "output_throughput": args.num_requests * args.max_tokens / duration,
              "ttft_ms_p50": statistics.median(prefills), "tpot_ms_p50": statistics.median(tpots)}
    text = json.dumps(result, indent=2)
    if args.result_json:
        Path(args.result_json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The executor alone, driven in-process: the floor under the stack.

`bench compare` sets this beside the whole stack on each random workload (same model, options,
threads, lengths and concurrency) to show what the bus, scheduler, api and detokenizer cost:
the stack's share is the served throughput over this one. At concurrency 1 each request is
one prefill step and then one decode step per token (greedy, EOS ignored), as the scheduler
plans a lone request; at concurrency C the requests go in waves of C, each wave's prompts in
one step and then its decodes in lockstep, every step full: the best any scheduler could do
with this executor, so the share says what the stages and the scheduling leave of it.

    python -m llmbus.bench.inprocess --num-requests 8 --input-len 256 --max-tokens 128
    python -m llmbus.bench.inprocess --num-requests 64 --concurrency 16 ...
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


def run_wave(runner, wave: list[list[int]], max_tokens: int,
             step_id: int) -> tuple[float, list[float], int]:
    """C requests at once: (prefill seconds, seconds of each decode step, next step id)."""
    from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    size = runner.block_size
    tables, next_block = [], 1
    for prompt in wave:
        num_blocks = -(-(len(prompt) + max_tokens) // size)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    ids = [f"w{step_id}-{i}" for i in range(len(wave))]
    start = time.perf_counter()
    _checked(runner.step(StepPlan(
        step_id=step_id, new_requests=[NewRequestData(i, list(p), params)
                                       for i, p in zip(ids, wave, strict=True)],
        scheduled=[ScheduledRequest(i, 0, len(p), t)
                   for i, p, t in zip(ids, wave, tables, strict=True)])))
    prefill, steps, last = time.perf_counter() - start, [], time.perf_counter()
    for k in range(max_tokens - 1):
        step_id += 1
        _checked(runner.step(StepPlan(step_id=step_id, scheduled=[
            ScheduledRequest(i, len(p) + k, 1) for i, p in zip(ids, wave, strict=True)])))
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    runner.step(StepPlan(step_id=step_id + 1, finished_sequence_ids=ids))
    return prefill, steps, step_id + 2


def _checked(result):
    if result.error:
        raise RuntimeError(result.error)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF model (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests at once: waves of this many, in lockstep (default: 1)")
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
    per_request = -(-(args.input_len + args.max_tokens) // 16)
    runner = ModelRunner(path, model_name=model_name_for(path), num_threads=args.threads,
                         num_blocks=per_request * args.concurrency + 2,
                         backend="auto", exact=args.exact)
    dataset = random_dataset(tokenizer, num_requests=args.num_requests + 1,
                             input_len=args.input_len, seed=args.seed)
    prompts = [tokenizer.encode(r.prompt or "") for r in dataset]
    step_id = run_request(runner, "warmup", prompts[0], 8, 0)[2]
    prefills, tpots, started = [], [], time.perf_counter()
    if args.concurrency == 1:
        for i, prompt in enumerate(prompts[1:]):
            prefill, gaps, step_id = run_request(runner, f"r{i}", prompt, args.max_tokens,
                                                 step_id)
            prefills.append(prefill * 1000)
            tpots.append(statistics.fmean(gaps) * 1000)
    else:
        for first in range(1, len(prompts), args.concurrency):
            wave = prompts[first:first + args.concurrency]
            prefill, gaps, step_id = run_wave(runner, wave, args.max_tokens, step_id)
            prefills += [prefill * 1000] * len(wave)
            tpots += [statistics.fmean(gaps) * 1000] * len(wave)
    duration = time.perf_counter() - started
    result = {"precision": "exact" if args.exact else "fast", "threads": runner.num_threads,
              "num_requests": args.num_requests, "concurrency": args.concurrency,
              "input_len": args.input_len,
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

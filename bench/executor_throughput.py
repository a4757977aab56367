"""End-to-end generation throughput of the executor (`ModelRunner`) at several batch sizes.

Drives `runner.step` the way the scheduler does: one prefill step for every prompt, then one
decode step per token for the whole batch, greedy. Uses the default model (pulled with
`llmbus model pull` when missing) unless --model is given. On CUDA the model takes the Triton
kernels; --kernels torch measures the unfused path for comparison. Without CUDA it says so and
exits 0, unless --device cpu is asked for.

    python bench/executor_throughput.py [--device cuda] [--dtype bfloat16]
        [--batch-sizes 1,16,64] [--prompt-len 128] [--new-tokens 128] [--kernels triton]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan  # noqa: E402

BLOCK_SIZE = 16


def generate(runner, prompts: list[list[int]], new_tokens: int,
             tag: str) -> tuple[float, float, list[list[int]]]:
    """(prefill seconds, decode seconds, sampled tokens); the batch advances in lockstep."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    free = list(range(1, runner.kv_cache.num_blocks))
    tables: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    new = [NewRequestData(request_id=r, prompt_token_ids=p, params=SamplingParams(temperature=0))
           for r, p in zip(ids, prompts, strict=True)]
    timings = []
    for step_id in range(new_tokens):
        scheduled = []
        for i, prompt in enumerate(prompts):
            end = len(prompt) + len(outputs[i])
            blocks = [free.pop() for _ in range(-(-end // BLOCK_SIZE) - len(tables[i]))]
            tables[i] += blocks
            scheduled.append(ScheduledRequest(request_id=ids[i], start=computed[i],
                                              num_tokens=end - computed[i], new_block_ids=blocks))
            computed[i] = end
        started = time.perf_counter()
        result = runner.step(StepPlan(step_id=step_id, new_requests=new, scheduled=scheduled))
        timings.append(time.perf_counter() - started)  # step() returns host ints: synced
        assert result.error == "", result.error
        new = []
        for i, token_id in enumerate(result.sampled_token_ids):
            outputs[i].append(token_id)
    runner.step(StepPlan(step_id=new_tokens, finished_request_ids=ids))
    return timings[0], sum(timings[1:]), outputs


def model_path(arg: str | None) -> Path:
    from services.model_files import default_model_path

    if arg:
        return Path(arg)
    path = default_model_path()
    if not path.is_file():
        from services.cli import main as llmbus

        assert llmbus(["model", "pull"]) == 0, "llmbus model pull failed"
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--weights", choices=["auto", "dense", "q4_1"], default="auto",
                        help="matmul weights (see `llmbus serve executor --help`)")
    parser.add_argument("--model", help="a GGUF file (default: the pulled default model)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/executor_throughput.py: no CUDA device found; nothing to measure "
              "(pass --device cpu to measure the CPU path).")
        return 0
    from services.executor.model import select_ops
    from services.executor.runner import ModelRunner

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_len = args.prompt_len + args.new_tokens
    num_blocks = max(batch_sizes) * -(-max_len // BLOCK_SIZE) + 1
    runner = ModelRunner(model_path(args.model), model_name="bench",
                         dtype=getattr(torch, args.dtype), block_size=BLOCK_SIZE,
                         num_blocks=num_blocks, num_threads=args.threads, device=device,
                         weights=args.weights)
    if args.kernels != "auto":
        runner.model.ops = select_ops(args.kernels, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, {args.dtype}, {runner.weight_format} weights, kernels "
          f"{runner.model.ops.name}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'prefill ms':>11} {'prefill tok/s':>14} {'ms/step':>8} "
          f"{'decode tok/s':>13}")
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    for batch in batch_sizes:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                   for _ in range(batch)]
        generate(runner, prompts, min(4, args.new_tokens), f"warmup{batch}")  # compile, cache
        prefill_s, decode_s, _ = generate(runner, prompts, args.new_tokens, f"b{batch}")
        steps = max(1, args.new_tokens - 1)
        print(f"{batch:>5} {1e3 * prefill_s:>11.1f} {batch * args.prompt_len / prefill_s:>14.0f} "
              f"{1e3 * decode_s / steps:>8.2f} {batch * steps / decode_s:>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generation throughput of the executor (`ModelRunner`, no bus) beside HF transformers.

Drives `runner.step` the way the scheduler does: one prefill step for every prompt, then one
decode step per token for the whole batch, greedy with EOS suppressed (as HF's min_new_tokens
does). HF `generate` runs the same prompts in the same process and run, so the ratio and the
"same as HF" column (sequences whose greedy tokens equal HF's) compare like with like. Before
the table it measures the machine: dense GEMM GFLOP/s per dtype and memory-copy GB/s, the
ceilings any backend here works under; each row's GFLOP/s is what its decode achieved.

    python -m llmbus.bench.executor_throughput [--device cpu|cuda] [--backends fast,exact]
        [--batch-sizes 1,16,64] [--prompt-len 128] [--new-tokens 32] [--no-hf]
        [--kernels auto|torch|triton] [--threads N]

Defaults: on the CPU, the fast and exact modes (the backends `llmbus up` and `llmbus up --exact`
choose, backend_choice.py) and the torch reference in float32 (and bfloat16 where the CPU has it
natively); on CUDA, the torch backend in bfloat16 with the Triton kernels.
Without CUDA, --device cuda says so and exits 0.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan  # noqa: E402

BLOCK_SIZE = 16


def generate(runner, prompts: list[list[int]], new_tokens: int,
             tag: str) -> tuple[float, float, list[list[int]]]:
    """(prefill seconds, decode seconds, sampled tokens); the batch advances in lockstep."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    free = list(range(1, runner.kv_cache.num_blocks))
    tables: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    params = SamplingParams(temperature=0, min_tokens=new_tokens)  # EOS suppressed, like HF
    new = [NewRequestData(sequence_id=r, prompt_token_ids=p, params=params)
           for r, p in zip(ids, prompts, strict=True)]
    timings = []
    for step_id in range(new_tokens):
        scheduled = []
        for i, prompt in enumerate(prompts):
            end = len(prompt) + len(outputs[i])
            blocks = [free.pop() for _ in range(-(-end // BLOCK_SIZE) - len(tables[i]))]
            tables[i] += blocks
            scheduled.append(ScheduledRequest(sequence_id=ids[i], start=computed[i],
                                              num_tokens=end - computed[i], new_block_ids=blocks))
            computed[i] = end
        started = time.perf_counter()
        result = runner.step(StepPlan(step_id=step_id, new_requests=new, scheduled=scheduled))
        timings.append(time.perf_counter() - started)  # step() returns host ints: synced
        assert result.error == "", result.error
        new = []
        for i, token_id in enumerate(result.sampled_token_ids):
            outputs[i].append(token_id)
    runner.step(StepPlan(step_id=new_tokens, finished_sequence_ids=ids))
    return timings[0], sum(timings[1:]), outputs


def model_path(arg: str | None) -> Path:
    from llmbus.services.model_files import default_model_path

    if arg:
        return Path(arg)
    path = default_model_path()
    if not path.is_file():
        from llmbus.services.cli import main as llmbus

        assert llmbus(["model", "pull"]) == 0, "llmbus model pull failed"
    return path


def _seconds(fn, device: torch.device, repeat: int, trials: int = 3) -> float:
    """Best of `trials` means of `repeat` calls: a ceiling, so noise must not lower it."""
    fn()
    best = float("inf")
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - started) / repeat)
    return best


def machine_ceilings(device: torch.device, dtypes: list[str]) -> dict[str, float]:
    """Dense GEMM GFLOP/s per dtype at a decode-like shape, and memory-copy GB/s."""
    ceilings = {}
    m, k, n = 64, 576, 3072  # 64 rows through SmolLM2's gate/up projection
    for name in dict.fromkeys(["float32", *(d for d in dtypes if hasattr(torch, d))]):
        dtype = getattr(torch, name)
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        seconds = _seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w), device, 50)
        ceilings[name] = 2 * m * k * n / seconds / 1e9
    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device)  # 256 MiB, beyond caches
    dst = torch.empty_like(src)
    seconds = _seconds(lambda: dst.copy_(src), device, 5)
    ceilings["copy_gbps"] = 2 * src.numel() * 4 / seconds / 1e9  # read + write
    return ceilings


def matmul_params(config) -> int:
    """Weights one token multiplies by: every layer's projections plus the vocab head."""
    d, f = config.hidden_size, config.intermediate_size
    qkv = d * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_layer = qkv + config.num_heads * config.head_dim * d + 3 * d * f
    return config.num_layers * per_layer + config.vocab_size * d


@dataclass
class Row:
    batch: int
    backend: str
    prefill_s: float
    decode_tok_s: float
    outputs: list[list[int]]


def run_llmbus(args, device, dtype: str, prompts_by_batch: dict[int, list[list[int]]],
               path: Path) -> list[Row]:
    """`dtype`: "fast" or "exact" (the CPU's default backends), or a torch backend dtype."""
    from llmbus.services.executor.backends.torch_llama import select_ops
    from llmbus.services.executor.runner import ModelRunner

    max_len = args.prompt_len + args.new_tokens
    num_blocks = max(prompts_by_batch) * -(-max_len // BLOCK_SIZE) + 1
    if dtype in ("fast", "exact"):
        options = dict(backend="auto", exact=dtype == "exact")
    else:
        options = dict(backend="torch", dtype=getattr(torch, dtype))
    runner = ModelRunner(path, model_name="bench", block_size=BLOCK_SIZE, num_blocks=num_blocks,
                         num_threads=args.threads, device=device, **options)
    if args.kernels != "auto":
        runner.model.ops = select_ops(args.kernels, device)
    backend = f"llmbus {dtype}: {runner.choice.backend}" + \
        (f" {runner.model.ops.name}" if device.type == "cuda" else "")
    rows = []
    for batch, prompts in prompts_by_batch.items():
        generate(runner, prompts, min(4, args.new_tokens), f"warmup{batch}")  # allocator, caches
        prefill_s, decode_s, outputs = generate(runner, prompts, args.new_tokens, f"b{batch}")
        steps = max(1, args.new_tokens - 1)
        rows.append(Row(batch, backend, prefill_s, batch * steps / decode_s, outputs))
        print(f"  {backend}, batch {batch}: {rows[-1].decode_tok_s:.0f} tok/s", file=sys.stderr)
    return rows


def run_hf(args, device, prompts_by_batch: dict[int, list[list[int]]], path: Path,
           eos_token_id: int) -> list[Row]:
    from llmbus.bench.hf_baseline import load_model, measure

    model = load_model(path, args.hf_dtype, str(device))
    rows = []
    for batch, prompts in prompts_by_batch.items():
        measure(model, prompts, min(4, args.new_tokens), eos_token_id)  # warm up
        stats, outputs = measure(model, prompts, args.new_tokens, eos_token_id)
        rows.append(Row(batch, f"HF {args.hf_dtype}", stats["prefill_ms"] / 1e3,
                        1e3 * batch / stats["decode_step_ms"], outputs))
        print(f"  HF, batch {batch}: {rows[-1].decode_tok_s:.0f} tok/s", file=sys.stderr)
    del model
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--backends", "--engines", dest="backends", default=None,
                        help="comma-separated: fast, exact (the CPU's backends) and torch "
                             "dtypes (float32, bfloat16, float16) (default: fast,exact,float32 "
                             "on the CPU, plus bfloat16 where the CPU has it natively; "
                             "bfloat16 on CUDA)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--hf-dtype", default="float32", help="HF's dtype (default: float32)")
    parser.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto",
                        help="the model's non-matmul ops: auto = triton on CUDA, torch on the "
                             "CPU")
    parser.add_argument("--model", help="a GGUF file (default: the pulled default model)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/executor_throughput.py: no CUDA device found; nothing to measure "
              "(the default --device cpu measures the CPU path).")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    from llmbus.services.cpu_features import has_native_bfloat16

    cpu_default = "fast,exact,float32" + (
        ",bfloat16" if has_native_bfloat16() else "")
    dtypes = (args.backends or ("bfloat16" if device.type == "cuda" else cpu_default)).split(",")
    path = model_path(args.model)
    from llmbus.services.executor.weights.gguf_loader import load_gguf
    from llmbus.services.gguf_tokenizer import GGUFTokenizer

    config = load_gguf(path)[0]
    eos = GGUFTokenizer.from_gguf(path).eos_token_id
    rng = random.Random(0)
    prompts_by_batch = {
        batch: [[rng.randrange(3, config.vocab_size) for _ in range(args.prompt_len)]
                for _ in range(batch)]
        for batch in (int(b) for b in args.batch_sizes.split(","))}

    ceilings = machine_ceilings(device, dtypes)
    rows = []
    for dtype in dtypes:
        rows += run_llmbus(args, device, dtype, prompts_by_batch, path)
    hf = {} if args.no_hf else {r.batch: r for r in run_hf(args, device, prompts_by_batch, path,
                                                           eos)}
    print_report(args, device, rows, hf, ceilings, matmul_params(config))
    return 0


def _same_as(row: Row, hf: Row | None) -> str:
    if hf is None:
        return "-"
    same = sum(a == b for a, b in zip(row.outputs, hf.outputs, strict=True))
    return f"{same}/{len(row.outputs)}"


def print_report(args, device, rows: list[Row], hf: dict[int, Row], ceilings: dict[str, float],
                 params: int) -> None:
    from llmbus.services.cpu_features import cpu_label

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_label()
    gemm = ", ".join(f"{k} {v:.0f}" for k, v in ceilings.items() if k != "copy_gbps")
    print(f"# {name}, {torch.get_num_threads()} threads, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy")
    print(f"# machine: dense GEMM GFLOP/s ({gemm}) at 64x576 @ 576x3072; "
          f"memory copy {ceilings['copy_gbps']:.1f} GB/s")
    print(f"# decode GFLOP/s = 2 x {params / 1e6:.0f}M matmul weights x decode tok/s; "
          "'same as HF' = sequences whose greedy tokens all equal HF's")
    print(f"{'batch':>5}  {'backend':<28} {'prefill ms':>10} {'decode tok/s':>12} "
          f"{'x HF':>6} {'GFLOP/s':>8} {'same as HF':>10}")
    for row in sorted(rows + list(hf.values()), key=lambda r: (r.batch, r.backend)):
        base = hf.get(row.batch)
        ratio = f"{row.decode_tok_s / base.decode_tok_s:.2f}" if base else "-"
        same = "-" if row is base else _same_as(row, base)
        print(f"{row.batch:>5}  {row.backend:<28} {1e3 * row.prefill_s:>10.0f} "
              f"{row.decode_tok_s:>12.0f} {ratio:>6} "
              f"{2 * params * row.decode_tok_s / 1e9:>8.1f} {same:>10}")


if __name__ == "__main__":
    sys.exit(main())

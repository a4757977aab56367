"""Many LoRA adapters against the base alone, at the same load, in one run (issue 44's table).

One stack serves the model with 8 adapters (rank 16 by default, on all seven projections: the
most a step's deltas can cost; `--targets q,v` is PEFT's default), written as llama.cpp GGUF
adapters with random weights. The
same load runs twice: every request for the base, then the requests spread over the 8
adapters in turn, so that every step mixes them. It prints both runs' output tok/s and ITL, and
their ratio (target: at least 0.75).

    python -m llmbus.bench.lora_throughput [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import gguf
import httpx
import numpy as np

from llmbus.bench.client import ServerTokenizer, stream_request
from llmbus.bench.datasets import random_dataset, request_body
from llmbus.bench.metrics import summarize
from llmbus.bench.stack import start_stack, stop_stack
from llmbus.services.executor.weights.lora_files import base_shape
from llmbus.services.executor.weights.model_config import LlamaConfig, read_config
from llmbus.services.gguf_metadata import read_metadata, read_tensor_infos
from llmbus.services.model_files import default_model_path, model_name_for

GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
              "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


def write_adapter(path: Path, config: LlamaConfig, arch: str, rank: int, seed: int,
                  targets: list[str]) -> None:
    """A GGUF adapter as llama.cpp's converter writes one, random A and B (B not zero)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(2 * rank))
    for layer in range(config.num_layers):
        for target in targets:
            name = GGUF_NAMES[target]
            out, inp = base_shape(config, target)
            a = rng.standard_normal((rank, inp)) / inp ** 0.5
            b = rng.standard_normal((out, rank)) * 0.1 / rank ** 0.5
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_a", a.astype(np.float32))
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


async def _load(base_url: str, models: list[str], requests, concurrency: int,
                max_tokens: int) -> dict:
    """Every request streamed, request i asking for models[i % len(models)]."""
    url = f"{base_url}/completions"
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(index, request):
            async with gate:
                body = request_body(request, chat=False, model=models[index % len(models)],
                                    max_tokens=max_tokens, ignore_eos=True, include_usage=True)
                return await stream_request(client, url, body, headers={},
                                            prompt_len=request.prompt_len)
        started = time.perf_counter()
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return summarize(results, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="the GGUF to serve (default: the pulled default model)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down",
                        help="the projections each adapter changes (default: all seven; "
                             "PEFT's default for Llama is q,v)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model_path = args.model or default_model_path()
    metadata = read_metadata(model_path)
    infos = read_tensor_infos(model_path)
    config = read_config(metadata, {n: i.shape for n, i in infos.items()})
    with tempfile.TemporaryDirectory() as work_dir:
        names = [f"adapter{i}" for i in range(args.adapters)]
        options = []
        for i, name in enumerate(names):
            path = Path(work_dir) / f"{name}.gguf"
            write_adapter(path, config, metadata["general.architecture"], args.rank, seed=i,
                          targets=args.targets.split(","))
            options += ["--lora", f"{name}={path}"]
        stack = start_stack(Path(work_dir), "--model", str(model_path), "--enable-lora",
                            "--max-loras", str(args.adapters), *options, timeout=600)
        try:
            base = model_name_for(model_path)
            tokenizer = ServerTokenizer(stack.base_url, base)
            requests = random_dataset(tokenizer, num_requests=args.requests,
                                      input_len=args.input_len, seed=1)
            tokenizer.close()
            asyncio.run(_load(stack.base_url, names, requests[:args.adapters], args.adapters,
                              4))  # warm-up: every adapter prepared on the engine
            runs = {"base alone": [base], f"{args.adapters} adapters mixed": names}
            results = {label: asyncio.run(_load(stack.base_url, models, requests,
                                                args.concurrency, args.max_tokens))
                       for label, models in runs.items()}
        finally:
            stop_stack(stack)
    print(f"model {model_path.name}; {args.adapters} adapters of rank {args.rank} on "
          f"{args.targets}; {args.requests} requests at {args.concurrency} concurrent, "
          f"{args.input_len} in / {args.max_tokens} out")
    print("| run | output tok/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms | failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        print(f"| {label} | {r['output_throughput']:.1f} | {r['itl_ms']['p50']:.1f} | "
              f"{r['itl_ms']['p99']:.1f} | {r['ttft_ms']['p50']:.0f} | {r['failed']} |")
    base_run, mixed_run = results.values()
    print(f"\nadapters / base output tok/s: "
          f"{mixed_run['output_throughput'] / base_run['output_throughput']:.2f}x "
          "(target >= 0.75)")
    return 1 if any(r["failed"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

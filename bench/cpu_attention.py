"""The C++ paged decode attention (kernels/cpu/paged_attention.cpp) on the default model's
shapes, against the torch reference it replaces, with the memory traffic it implies.

    python -m llmbus.bench.cpu_attention [--threads 2] [--isa native|avx2|avx512]

Cases: one decode; 16 decodes over their own blocks (bound by memory: GB/s is printed beside
this machine's copy bandwidth); 16 decodes behind one shared 1,024-token prefix (a layer's
prefix fits in L2/L3, so this one is bound by arithmetic). Each call takes the next of 30
layers' caches, as a step does, so a layer's KV is not still in cache from the call before.
Microseconds per layer call, median of steps, and each against the time its KV bytes take at
the machine's read bandwidth (issue 40's bar for 16 decodes: 1.5x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from llmbus.services.executor.kernels.cpu.library import configure_openmp  # noqa: E402

configure_openmp()  # as the executor service does, before torch loads

import torch  # noqa: E402

from llmbus.services.cpu_features import cpu_label  # noqa: E402
from llmbus.services.executor.attention.cpu_paged import PagedAttention  # noqa: E402
from llmbus.services.executor.attention.metadata import build_attention_metadata  # noqa: E402
from llmbus.services.executor.backends.torch_llama import TorchOps  # noqa: E402
from llmbus.services.executor.kernels.cpu.library import load_library  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M, llmbus's block size


LAYERS = 30


def median_us(fn, repeats: int = 15, calls: int = 1) -> float:
    """Median wall time of `fn()` over `repeats`, divided by `calls` (calls per `fn`)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / calls


def copy_gbps() -> float:
    """Read + write bandwidth of a 256 MB copy: what a memory-bound kernel can approach."""
    src, dst = torch.ones(64 << 20), torch.empty(64 << 20)
    return 2 * src.numel() * 4 / median_us(lambda: dst.copy_(src), 5) / 1e3


def read_gbps() -> float:
    """Read bandwidth of a 256 MB sum: the time to read a kernel's bytes, at best."""
    src = torch.ones(64 << 20)
    return src.numel() * 4 / median_us(lambda: src.sum(), 5) / 1e3


def case(num_seqs: int, context: int, shared: int, kv_dtype: torch.dtype, query: int = 1):
    """Metadata, qkv, rotary rows and a cache: `num_seqs` sequences of `query` new tokens at
    `context` tokens, the first `shared` of which sit in blocks every sequence shares."""
    shared_blocks = shared // BLOCK
    own = -(-context // BLOCK) - shared_blocks
    num_blocks = 1 + shared_blocks + num_seqs * own
    prefix = list(range(1, 1 + shared_blocks))
    tables = [prefix + list(range(1 + shared_blocks + s * own, 1 + shared_blocks + (s + 1) * own))
              for s in range(num_seqs)]
    meta = build_attention_metadata([query] * num_seqs, [context] * num_seqs, tables, BLOCK)
    qkv = torch.randn(num_seqs * query, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    angles = torch.rand(num_seqs * query, HEAD_DIM // 2) * 6
    emb = torch.cat([angles, angles], dim=-1)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape).to(kv_dtype), torch.randn(shape).to(kv_dtype))
              for _ in range(LAYERS)]
    return meta, qkv, emb.cos(), emb.sin(), caches


def measure(kernel: PagedAttention, meta, qkv, cos, sin, caches) -> tuple[float, float]:
    """µs per layer call: the kernel over the 30 layers' caches in turn, and the torch path
    (gather + SDPA, float32 cache) on one."""
    scale = HEAD_DIM ** -0.5

    def step():
        for k, v in caches:
            kernel(qkv, cos, sin, k, v, meta, HEADS, scale)

    kf, vf = caches[0][0].float(), caches[0][1].float()

    def reference():
        q = TorchOps.rope_write_kv(qkv, cos, sin, kf, vf, meta.slot_mapping, HEADS)
        return TorchOps.attention(q, kf, vf, meta, scale)

    return median_us(step, calls=LAYERS), median_us(reference, 10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--isa", default=None, help="kernel build: native, avx2 or avx512")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = load_library(args.isa)
    if lib is None:
        print("no C++ compiler: nothing to measure")
        return 0
    kernel = PagedAttention(lib, args.threads)
    read = read_gbps()
    print(f"# {cpu_label()}; {args.threads} threads; kernel build {args.isa or 'default'}; "
          f"copy bandwidth {copy_gbps():.1f} GB/s (read + write), read {read:.1f} GB/s")
    # GB/s: the KV bytes each query reads; x read: decodes' time over those bytes' at `read`
    print("| case | KV dtype | kernel µs | torch µs | KV read GB/s | x read time |")
    print("|---|---|---:|---:|---:|---:|")
    for name, seqs, context, shared, query in (
            ("1 decode, 300 tokens", 1, 300, 0, 1),
            ("16 decodes, 1,060 tokens each", 16, 1060, 0, 1),
            ("16 decodes, shared 1,024 prefix", 16, 1060, 1024, 1),
            ("16 chunks of 32 behind a shared 1,024 prefix", 16, 1056, 1024, 32),
            ("1 fresh prompt of 256", 1, 256, 0, 256)):
        for kv_dtype in (torch.float16, torch.float32):
            us, ref_us = measure(kernel, *case(seqs, context, shared, kv_dtype, query))
            bytes_read = 2 * seqs * context * KV_HEADS * HEAD_DIM * kv_dtype.itemsize
            ratio = f"{us * read * 1e3 / bytes_read:.2f}" if query == 1 else "-"
            print(f"| {name} | {str(kv_dtype).removeprefix('torch.')} | {us:,.0f} | "
                  f"{ref_us:,.0f} | {bytes_read / us / 1e3:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmarks: each fused Triton kernel against the unfused torch path it replaces.

Needs a CUDA device; without one it says so and exits 0. Prints microseconds per call (median
of triton's do_bench) and, for paged decode attention, the achieved memory bandwidth in GB/s
and as a fraction of the device's peak (table below, or --peak-gbps). A small kernel's call
is mostly the host's launch (Python and the driver, ~20-40 us); `--cuda-graphs` replays each
call from a captured graph instead, so the times are the device's alone (sampling, whose torch
path syncs with the host, is then left out).

    python -m llmbus.bench.kernels [--shapes smollm2-135m|llama-8b] [--dtype bfloat16]
        [--cuda-graphs]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

# HBM bandwidth in GB/s from the vendors' datasheets; the first substring of the device name
# that matches wins, so the more specific names come first.
PEAK_GBPS = [
    ("GH200", 4000), ("H200", 4800), ("H100 PCIe", 2000), ("H100 NVL", 3900), ("H100", 3350),
    ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555),
    ("L40S", 864), ("L40", 864), ("L4", 300), ("A10G", 600), ("A10", 600),
    ("RTX 4090", 1008), ("RTX 3090", 936), ("T4", 320), ("V100", 900),
]


@dataclass(frozen=True)
class Shapes:
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int


SHAPES = {
    "smollm2-135m": Shapes(576, 1536, 9, 3, 64, 49152),  # the default model
    "llama-8b": Shapes(4096, 14336, 32, 8, 128, 128256),
}
BLOCK_SIZE = 16
DEVICE = "cuda"


def peak_gbps(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


CUDA_GRAPHS = False  # --cuda-graphs


def time_us(fn: Callable[[], object]) -> float:
    import triton.testing

    if CUDA_GRAPHS:
        try:
            return 1000 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        except RuntimeError as e:  # a host sync inside: it cannot be captured
            print(f"# not capturable, timed as launched calls: {str(e).splitlines()[0]}")
            torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def report(name: str, shape: str, fused: Callable, unfused: Callable, extra: str = "") -> float:
    fused_us, unfused_us = time_us(fused), time_us(unfused)
    print(f"{name:<24} {shape:<28} {fused_us:9.1f} {unfused_us:9.1f} "
          f"{unfused_us / fused_us:7.2f}x  {extra}")
    return fused_us


def paged_setup(context_lens: list[int], query_lens: list[int], s: Shapes, dtype):
    """Caches holding every context, shuffled block tables, and the model's metadata."""
    from llmbus.services.executor.attention.metadata import build_attention_metadata

    num_blocks = sum(-(-n // BLOCK_SIZE) for n in context_lens) + 1
    shape = (num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in context_lens]
    meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, DEVICE)
    q = torch.randn(sum(query_lens), s.num_heads, s.head_dim, dtype=dtype, device=DEVICE)
    return q, k_cache, v_cache, meta


def bench_elementwise(s: Shapes, dtype, num_tokens: int) -> None:
    from llmbus.services.executor.backends.torch_llama import TorchOps
    from llmbus.services.executor.kernels.triton import rmsnorm, rope_kv, swiglu

    x = torch.randn(num_tokens, s.hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn_like(x)
    weight = torch.randn(s.hidden, dtype=dtype, device=DEVICE)
    report("add_rms_norm", f"T={num_tokens} D={s.hidden}",
           lambda: rmsnorm.add_rms_norm(x, residual, weight, 1e-5),
           lambda: TorchOps.add_rms_norm(residual, x, weight, 1e-5))

    width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    qkv = torch.randn(num_tokens, width, dtype=dtype, device=DEVICE)
    cos = torch.randn(num_tokens, s.head_dim, dtype=dtype, device=DEVICE)
    sin = torch.randn_like(cos)
    num_blocks = num_tokens // BLOCK_SIZE + 2
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim, dtype=dtype,
                          device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_tokens, device=DEVICE) + BLOCK_SIZE
    report("rope_kv", f"T={num_tokens} H={s.num_heads}/{s.num_kv_heads}",
           lambda: rope_kv.rope_kv(qkv, cos, sin, k_cache, v_cache, slots, s.num_heads),
           lambda: TorchOps.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, s.num_heads))

    gate_up = torch.randn(num_tokens, 2 * s.ffn, dtype=dtype, device=DEVICE)
    report("swiglu", f"T={num_tokens} F={s.ffn}", lambda: swiglu.swiglu(gate_up),
           lambda: TorchOps.silu_mul(gate_up))


def bench_decode(s: Shapes, dtype, num_seqs: int, context_len: int, peak: float | None) -> None:
    from llmbus.services.executor.attention.torch_paged import paged_attention
    from llmbus.services.executor.kernels.triton.paged_decode_attention import (
        multiprocessors,
        paged_decode_attention,
        partition_size_for,
    )

    lens = [context_len] * num_seqs
    q, k_cache, v_cache, meta = paged_setup(lens, [1] * num_seqs, s, dtype)
    scale = s.head_dim ** -0.5
    fused_us = time_us(lambda: paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                                      meta.context_lens, scale))
    unfused_us = time_us(lambda: paged_attention(q, k_cache, v_cache, meta, scale))
    element = q.element_size()
    kv_bytes = 2 * sum(lens) * s.num_kv_heads * s.head_dim * element
    moved = kv_bytes + 2 * q.numel() * element + meta.block_tables.numel() * 4
    gbps = moved / fused_us / 1e3
    share = f" = {gbps / peak:.0%} of {peak:.0f}" if peak else " (peak unknown: --peak-gbps)"
    chosen = partition_size_for(num_seqs, s.num_kv_heads, context_len, multiprocessors(q.device))
    if chosen != 512:  # what the chosen partitions bought over the coarsest
        coarse_us = time_us(lambda: paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, 512))
        share += f"; partitions of {chosen} (at 512: {coarse_us:.1f} us)"
    print(f"{'paged_decode_attention':<24} {f'B={num_seqs} ctx={context_len}':<28} "
          f"{fused_us:9.1f} {unfused_us:9.1f} {unfused_us / fused_us:7.2f}x  "
          f"{gbps:.0f} GB/s{share}")


def bench_prefill(s: Shapes, dtype, num_seqs: int, chunk: int, prefix: int) -> None:
    from llmbus.services.executor.attention.torch_paged import paged_attention
    from llmbus.services.executor.kernels.triton.prefill_attention import prefill_attention

    q, k_cache, v_cache, meta = paged_setup([prefix + chunk] * num_seqs, [chunk] * num_seqs,
                                            s, dtype)
    scale = s.head_dim ** -0.5
    flops = 4 * num_seqs * s.num_heads * s.head_dim * chunk * (prefix + chunk / 2)
    fused_us = report(
        "prefill_attention", f"B={num_seqs} chunk={chunk} prefix={prefix}",
        lambda: prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                  meta.context_lens, chunk, scale),
        lambda: paged_attention(q, k_cache, v_cache, meta, scale))
    print(f"{'':<24} {'':<28} {flops / fused_us / 1e6:9.1f} TFLOP/s (causal)")


def bench_sampling(s: Shapes, num_rows: int) -> None:
    from llmbus.services.executor.kernels.triton.sampling import sample
    from llmbus.services.executor.sampling.sampler import sample as torch_sample
    from llmbus.services.executor.sampling.sampling_tensors import SamplingTensors

    logits = torch.randn(num_rows, s.vocab, device=DEVICE) * 3
    tensors = SamplingTensors(
        temperature=torch.full((num_rows,), 0.8, device=DEVICE),
        top_k=torch.full((num_rows,), 50, dtype=torch.int64, device=DEVICE),
        top_p=torch.full((num_rows,), 0.9, device=DEVICE),
        all_greedy=False, any_top_k=True, any_top_p=True)
    min_p = torch.zeros(num_rows, device=DEVICE)
    generators = [None] * num_rows

    def fused():
        noise = torch.empty_like(logits).exponential_()
        return sample(logits, noise, tensors.temperature, tensors.top_k, tensors.top_p, min_p)

    report("sampling (k=50 p=0.9)", f"S={num_rows} V={s.vocab}", fused,
           lambda: torch_sample(logits, tensors, generators))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        default="bfloat16")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="device memory bandwidth, overriding the built-in table")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="time replays of captured graphs: the device's time, no launch")
    args = parser.parse_args(argv)
    global CUDA_GRAPHS
    CUDA_GRAPHS = args.cuda_graphs
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA device; none found, nothing to measure.")
        return 0
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps(name)
    s, dtype = SHAPES[args.shapes], getattr(torch, args.dtype)
    print(f"# {name}, {args.shapes}, {args.dtype}, peak {peak or '?'} GB/s; "
          f"torch {torch.__version__}; "
          + ("graph replays (device time)" if CUDA_GRAPHS else "launched calls (host + device)"))
    print(f"{'kernel':<24} {'shape':<28} {'fused us':>9} {'torch us':>9} {'speedup':>8}")
    with torch.inference_mode():
        for num_tokens in (1, 64, 4096):
            bench_elementwise(s, dtype, num_tokens)
        for num_seqs, context_len in ((1, 4096), (16, 1024), (64, 2048), (64, 8192)):
            bench_decode(s, dtype, num_seqs, context_len, peak)
        for num_seqs, chunk, prefix in ((1, 2048, 0), (4, 512, 1536)):
            bench_prefill(s, dtype, num_seqs, chunk, prefix)
        for num_rows in () if CUDA_GRAPHS else (1, 64):
            bench_sampling(s, num_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

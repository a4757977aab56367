"""What a sliding window saves a decode: the C++ paged attention of one Gemma 3 layer (head
size 256, 4 query heads over 1 KV head, as Gemma 3 1B) at a long context, with the window of
its local layers (512 tokens) against the global layers' whole context, in the same run.

Prints ms per layer call for each batch size, and the ratio; a local layer should cost about
window / context of a global one (a decode reads only the blocks of its last `window`
positions), and a step of Gemma 3 (5 local layers of 6) about (5 * ratio + 1) / 6 of an all-
global one in attention. Usage:

    python -m llmbus.bench.sliding_window [--context 4096] [--window 512] [--batch 1,8]
"""

from __future__ import annotations

import argparse
import time

import torch

from llmbus.services.cpu_features import cpu_label
from llmbus.services.executor.attention.cpu_paged import PagedAttention
from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.kernels.cpu.library import load_library

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 1, 256, 16


def time_decode(attention: PagedAttention, batch: int, context: int, window: int,
                repeat: int) -> float:
    """Median seconds of one layer's decode step for `batch` sequences at `context` tokens."""
    blocks = -(-context // BLOCK)
    tables = [list(range(1 + b * blocks, 1 + (b + 1) * blocks)) for b in range(batch)]
    meta = build_attention_metadata([1] * batch, [context] * batch, tables, BLOCK)
    shape = (1 + batch * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape).half(), torch.randn(shape).half()
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    cos, sin = torch.ones(batch, HEAD_DIM), torch.zeros(batch, HEAD_DIM)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        attention(qkv, cos, sin, k, v, meta, HEADS, HEAD_DIM ** -0.5, window)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    lib = load_library()
    if lib is None:
        raise SystemExit("no C++ compiler: the CPU kernels were not built")
    attention = PagedAttention(lib, args.threads)
    print(f"CPU: {cpu_label()}; "
          f"{args.threads} threads; float16 KV; head size {HEAD_DIM}, {HEADS}/{KV_HEADS} heads")
    print(f"{'batch':>5} {'global ms':>10} {'window ms':>10} {'ratio':>6} "
          f"(window {args.window} of {args.context} tokens: {args.window / args.context:.3f})")
    for batch in (int(b) for b in args.batch.split(",")):
        full = time_decode(attention, batch, args.context, 0, args.repeat)
        local = time_decode(attention, batch, args.context, args.window, args.repeat)
        print(f"{batch:>5} {1e3 * full:>10.3f} {1e3 * local:>10.3f} {local / full:>6.3f}")


if __name__ == "__main__":
    main()

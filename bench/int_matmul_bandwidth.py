"""The integer kernel's matmuls of one step (int_step.cpp: every layer's QKV, O, gate/up and
down, in order, then the head), against the time their weight bytes take at this machine's
read bandwidth, measured in the same run.

    python -m llmbus.bench.int_matmul_bandwidth [--model F.gguf] [--tokens 1,16] [--isa avx2]

At one token a step streams every weight once and is bound by memory: the ratio says how
close the kernel comes to the bandwidth (1.0x is the bound). At a few dozen tokens the
arithmetic takes over. Each matrix kind's share is printed, medians of `--repeats` steps.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

from llmbus.services.executor.kernels.cpu.library import configure_openmp  # noqa: E402

configure_openmp()  # as the executor service does, before torch loads

import torch  # noqa: E402

from llmbus.bench.cpu_attention import read_gbps  # noqa: E402
from llmbus.services.cpu_features import cpu_label  # noqa: E402
from llmbus.services.executor.backends.int_step import ALWAYS, IntLinear  # noqa: E402
from llmbus.services.executor.weights.quant_parts import QuantPart  # noqa: E402


def weight_bytes(part: QuantPart) -> int:
    tensors = (part.codes, part.scales, part.mins, part.sub_scales, part.sub_mins,
               part.high_codes)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def step_matmuls(int_step) -> list[tuple[str, IntLinear, list[QuantPart]]]:
    """A step's matmuls in the order a step runs them, as the executor builds them."""
    work = []
    for layer in int_step._layers:
        for name in ("qkv", "o", "gate_up", "down"):
            parts = layer[name]
            wide = ALWAYS if name == "qkv" else 0  # as IntStep's boundaries take them
            work.append((name, IntLinear.of(parts, wide_rows=wide), parts))
    work.append(("head", IntLinear.of([int_step._head_parts]), [int_step._head_parts]))
    return work


def time_step(lib, work, tokens: int, threads: int, repeats: int) -> dict[str, float]:
    """Median ms per step of each matrix kind, and of the whole ("all")."""
    buffers = [(torch.randn(tokens, parts[0].k), torch.empty(tokens, sum(p.n for p in parts)))
               for _, _, parts in work]
    samples: dict[str, list[float]] = {}
    for repeat in range(repeats + 1):  # the first warms up
        kinds = dict.fromkeys((name for name, _, _ in work), 0.0)
        began = time.perf_counter()
        for (name, linear, _), (x, y) in zip(work, buffers, strict=True):
            start = time.perf_counter()
            if lib.int_linear(ctypes.byref(linear), x.data_ptr(), tokens, y.data_ptr(), 0,
                              threads):
                raise RuntimeError(f"int_linear refused {name}")
            kinds[name] += time.perf_counter() - start
        kinds["all"] = time.perf_counter() - began
        if repeat:
            for name, seconds in kinds.items():
                samples.setdefault(name, []).append(seconds * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: the pulled default model)")
    parser.add_argument("--tokens", default="1,16", help="tokens a step (comma-separated)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--isa", choices=["native", "avx2", "avx512"], default=None,
                        help="the kernel build (default: LLMBUS_CPU_ISA, else native)")
    args = parser.parse_args(argv)
    if args.isa:
        os.environ["LLMBUS_CPU_ISA"] = args.isa

    from llmbus.services.executor.runner import ModelRunner
    from llmbus.services.model_files import default_model_path

    runner = ModelRunner(args.model or default_model_path(), model_name="bench",
                         num_threads=args.threads, num_blocks=4, backend="auto")
    int_step = runner.model.int_step
    if int_step is None:
        print("this model's backend does not use the integer kernel", file=sys.stderr)
        return 1
    work = step_matmuls(int_step)
    total = sum(weight_bytes(p) for _, _, parts in work for p in parts)
    gbps = read_gbps()
    bound_ms = total / gbps / 1e6
    print(f"# {cpu_label()}; {args.threads} threads; {args.isa or 'default'} build; "
          f"{total / 1e6:.0f} MB of weights a step; read bandwidth {gbps:.1f} GB/s "
          f"({bound_ms:.2f} ms for those bytes)")
    kinds = list(dict.fromkeys(name for name, _, _ in work))
    print("| tokens | " + " | ".join(f"{k} ms" for k in kinds) +
          " | step ms | GB/s | x read time |")
    print("|---:|" + "---:|" * (len(kinds) + 3))
    for tokens in (int(t) for t in args.tokens.split(",")):
        ms = time_step(int_step.lib, work, tokens, args.threads, args.repeats)
        print(f"| {tokens} | " + " | ".join(f"{ms[k]:.2f}" for k in kinds) +
              f" | {ms['all']:.2f} | {total / ms['all'] / 1e6:.1f} | "
              f"{ms['all'] / bound_ms:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one decode step's time goes, in-process: the dense work (the integer kernel's calls,
or ONNX Runtime's graphs), attention, the rest of the forward (embedding, rotary rows, the
head's row gather), and everything outside the forward (sampling, logprobs, metadata, request
bookkeeping).

    python -m llmbus.bench.step_profile [--batch 1,16] [--context 300,1060] [--exact] [--threads 2]

Each case prefills `batch` requests of `context` tokens, then times decode steps of one token
per request through `ModelRunner.step`, the executor service's whole per-step work: first as
served (the integer kernel's layers and attention in one C++ call, step_layers.cpp, where the
model takes it), then through the Python loop over layers, whose calls are timed one by one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

from llmbus.services.executor.kernels.cpu.library import configure_openmp  # noqa: E402

configure_openmp()  # as the executor service does, before torch loads


class _Timed:
    """Wraps a callable, adding its wall time to `total`."""

    def __init__(self, fn) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - start


def profile(runner, batch: int, context: int, num_steps: int) -> dict[str, float]:
    """ms per decode step: as served, and through the Python loop with its forward, dense work
    and attention."""
    from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
    from llmbus.services.executor.backends import cpu_llama

    model = runner.model
    assert isinstance(model, cpu_llama.CpuLlamaModel)
    params = SamplingParams(temperature=0.0, max_tokens=context + 2 * num_steps, ignore_eos=True)
    blocks_each = -(-(context + 2 * num_steps) // runner.block_size)
    ids = [f"p{batch}-{context}-{b}" for b in range(batch)]
    runner.step(StepPlan(step_id=0, new_requests=[
        NewRequestData(ids[b], [1000 + (b * 7 + i) % 40000 for i in range(context)], params)
        for b in range(batch)], scheduled=[
        ScheduledRequest(ids[b], 0, context,
                         list(range(1 + b * blocks_each, 1 + (b + 1) * blocks_each)))
        for b in range(batch)]))

    def run_steps(first: int) -> float:
        start = time.perf_counter()
        for i in range(first, first + num_steps):
            result = runner.step(StepPlan(step_id=1 + i, scheduled=[
                ScheduledRequest(sequence_id, context + i, 1) for sequence_id in ids]))
            if result.error:
                raise RuntimeError(result.error)
        return time.perf_counter() - start

    served = run_steps(0)
    # The Python loop over layers, every call timed.
    graphs = list({id(g): g for g in model.graphs + model.single_thread_graphs}.values())
    timers = []
    for graph in graphs:
        graph.run = _Timed(graph.run)
        timers.append(graph.run)
    kernel, fused = (model.int_step.lib if model.int_step else None), model.fused_layers
    if kernel is not None:
        model.int_step.lib = types.SimpleNamespace(
            int_boundary=_Timed(kernel.int_boundary), int_head=_Timed(kernel.int_head))
        timers += [model.int_step.lib.int_boundary, model.int_step.lib.int_head]
    model.attend = attend = _Timed(model.attend)
    served_forward = runner.model_forward
    runner.model_forward = forward = _Timed(served_forward)
    model.fused_layers = False
    total = run_steps(num_steps)
    model.fused_layers = fused
    runner.model_forward = served_forward
    for graph in graphs:
        graph.run = graph.run.fn
    if kernel is not None:
        model.int_step.lib = kernel
    del model.attend  # back to the class's method
    runner.step(StepPlan(step_id=2 * num_steps + 1, finished_sequence_ids=ids))
    per_step = 1000 / num_steps
    return {"served": served * per_step, "step": total * per_step,
            "forward": forward.total * per_step,
            "dense": sum(t.total for t in timers) * per_step, "attention": attend.total * per_step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--context", default="300,1060")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--model", help="a GGUF file (default: the pulled default model)")
    args = parser.parse_args()

    from llmbus.services.cpu_features import cpu_label
    from llmbus.services.executor.runner import ModelRunner
    from llmbus.services.model_files import default_model_path

    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    blocks = max(batches) * (-(-(max(contexts) + 2 * args.steps) // 16)) + 2
    runner = ModelRunner(args.model or default_model_path(), model_name="profile",
                         num_threads=args.threads,
                         num_blocks=blocks, backend="auto", exact=args.exact)
    print(f"# {cpu_label()}; {args.threads} threads; "
          f"{'exact' if args.exact else 'fast'} mode; ms per decode step")
    print("| batch | context | step as served | step, Python loop over layers | dense work "
          "(matmuls, norms, SwiGLU, head) | attention (RoPE, KV write, attend) | rest of forward "
          "| outside forward (sampling, bookkeeping) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        for context in contexts:
            p = profile(runner, batch, context, args.steps)
            print(f"| {batch} | {context} | {p['served']:.1f} | {p['step']:.1f} | "
                  f"{p['dense']:.1f} | "
                  f"{p['attention']:.1f} | {p['forward'] - p['dense'] - p['attention']:.1f} | "
                  f"{p['step'] - p['forward']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

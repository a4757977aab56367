"""The executor's bus adapter: answers the scheduler's step plans with sampled tokens.

The forward runs in a worker thread so that the event loop keeps answering pings while the
model computes. Steps of one engine arrive one at a time (the scheduler waits for each reply).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import structlog
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode

from bus import subjects
from bus.messages import ExecutorInfo, ExecutorInfoRequest, Heartbeat, StepPlan, StepResult
from bus.runtime import ServiceRuntime
from bus.tracing import context_from_traceparent, link_to
from services.model_files import model_name_for, resolve_model

log = structlog.get_logger()
_tracer = trace.get_tracer("llmbus.executor")

DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("auto", "dense", "native")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-id", default="engine0",
                        help="name of the engine this executor serves (default: engine0)")
    parser.add_argument("--model", default=None,
                        help="path of a GGUF model (default: the pulled default model)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="compute dtype of weights and KV cache (default: float32)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                        help="matmul weights: dense (dequantized to --dtype), or native (the "
                             "GGUF's own Q4_0/Q4_1/Q8_0 blocks, read by quantized CPU kernels for "
                             "decode-sized steps: llmbus's exact float32 kernel, built with the "
                             "system's C++ compiler, or torch's int4 kernel for bfloat16); auto "
                             "= native where a kernel runs (default: auto)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model runs; cuda uses the Triton kernels "
                             "(default: auto = cuda when available, else cpu)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV-cache block (default: 16)")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="KV-cache budget in GiB (default: min(2 GiB, 25%% of free RAM))")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="exact number of KV blocks (overrides --kv-cache-memory)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context window (default: the model's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: all cores)")
    parser.add_argument("--small-step-threads", type=int, default=None,
                        help="threads for steps of at most 4 tokens, e.g. single-stream "
                             "decode (default: --threads minus one on machines of up to 4 "
                             "cores, which leaves a core to the other services, else "
                             "--threads)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to keep serving steps while the scheduler "
                             "finishes its requests (default: 30)")


def default_small_step_threads(threads: int) -> int:
    """One core left to the rest of the stack where cores are few (see runner.py)."""
    return max(1, threads - 1) if (os.cpu_count() or 1) <= 4 else threads


def _record_residency(request_id: str, started_ns: int, traceparent: str) -> None:
    """The request's time in this executor, as a span of its own trace (steps link to it)."""
    _tracer.start_span("executor.request", context=context_from_traceparent(traceparent),
                       start_time=started_ns,
                       attributes={"llmbus.request_id": request_id}).end()


async def main(args: argparse.Namespace) -> None:
    import torch  # only the executor pays for importing torch

    from services.executor.runner import ModelRunner

    runtime = ServiceRuntime("executor", args.nats_url, args.instance_id)
    await runtime.connect()
    runtime.install_signal_handlers()
    path = resolve_model(args.model)
    log.info("loading model", path=str(path), dtype=args.dtype, device=args.device,
             weights=args.weights)
    kv_bytes = int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.threads or os.cpu_count() or 1
    runner = await asyncio.to_thread(
        ModelRunner, path, model_name=model_name_for(path), dtype=getattr(torch, args.dtype),
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_bytes=kv_bytes,
        max_model_len=args.max_model_len, num_threads=threads,
        small_step_threads=args.small_step_threads or default_small_step_threads(threads),
        device=device, weights=args.weights)
    info = runner.info()
    log.info("model loaded", num_blocks=info.num_blocks, max_model_len=info.max_model_len,
             weights=runner.weight_format)

    async def on_info(_: ExecutorInfoRequest, __: Msg) -> ExecutorInfo:
        return info

    last_reply = time.perf_counter()
    links: dict[str, Link] = {}  # request id -> link to its trace, for step spans
    residents: dict[str, tuple[int, str]] = {}  # request id -> (registered at, traceparent)

    async def on_step(plan: StepPlan, _: Msg) -> StepResult:
        nonlocal last_reply
        idle = time.perf_counter() - last_reply
        runtime.num_handled += 1
        for request_id in plan.finished_request_ids:
            links.pop(request_id, None)
            if request_id in residents:
                _record_residency(request_id, *residents.pop(request_id))
        for new in plan.new_requests:
            link = link_to(new.traceparent)
            if link is not None:
                links[new.request_id] = link
                residents[new.request_id] = (time.time_ns(), new.traceparent)
        # One span per step, serving many requests: linked to each request's trace.
        step_links = [links[s.request_id] for s in plan.scheduled if s.request_id in links]
        with _tracer.start_as_current_span("executor.step", links=step_links, attributes={
                "llmbus.step_id": plan.step_id, "llmbus.batch_size": len(plan.scheduled),
                "llmbus.num_tokens": sum(s.num_tokens for s in plan.scheduled)}) as span:
            result = await asyncio.to_thread(runner.step, plan)
            if result.error:
                span.set_status(Status(StatusCode.ERROR, result.error))
        result.idle_seconds = idle
        last_reply = time.perf_counter()
        return result

    await runtime.on_request(subjects.executor_info(args.engine_id), ExecutorInfoRequest, on_info)
    await runtime.on_request(subjects.executor_step(args.engine_id), StepPlan, on_step)
    runtime.ready = True
    runtime.start_heartbeat(lambda: Heartbeat(
        service="executor", instance_id=runtime.instance_id, engine_id=args.engine_id,
        num_handled=runtime.num_handled))
    try:
        await runtime.stop_event.wait()
        # Keep serving while the scheduler drains: stop after 1 s without a step.
        deadline = time.monotonic() + args.shutdown_timeout
        while time.monotonic() < deadline and time.perf_counter() - last_reply < 1.0:
            await asyncio.sleep(0.1)
    finally:
        await runtime.close()

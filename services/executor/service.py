"""The executor's bus adapter: answers the scheduler's step plans with sampled tokens.

The forward runs in a worker thread so that the event loop keeps answering pings while the
model computes: always the same one, since OpenMP gives every thread that starts parallel work
a team of its own, and teams of alternating threads would fight over the cores (2 Zen 4 cores,
one stream: ~15 ms per token with the default pool's threads taking turns, ~11 with one). Steps
of one engine arrive one at a time (the bus hands this handler one message after another).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode

from llmbus.bus import subjects
from llmbus.bus.messages import (
    ExecutorInfo,
    ExecutorInfoRequest,
    GrammarReply,
    GrammarRequest,
    Heartbeat,
    KvChunk,
    KvReceive,
    KvReply,
    StepPlan,
    StepResult,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.bus.tracing import context_from_traceparent, link_to
from llmbus.services.executor.kernels.cpu.library import configure_openmp
from llmbus.services.executor.plan import DTYPES, ENGINES, ExecutionPlan, resolve_plan
from llmbus.services.model_files import model_name_for, resolve_model

if TYPE_CHECKING:
    from llmbus.services.executor.kv_transfer import KvReceiver, KvSender
    from llmbus.services.executor.runner import ModelRunner

log = structlog.get_logger()
_tracer = trace.get_tracer("llmbus.executor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-id", default="engine0",
                        help="name of the engine this executor serves (default: engine0)")
    parser.add_argument("--model", default=None,
                        help="path of a GGUF model (default: the pulled default model)")
    parser.add_argument("--exact", action="store_true",
                        help="float32 activations and KV cache on the GGUF's exact weight "
                             "values, so greedy output equals HF transformers token for token "
                             "(ONNX Runtime's graphs on a CPU). Default: the fast mode, int8 "
                             "activations in the matmuls and a float16 KV cache, as llama.cpp "
                             "computes (perplexity within 1%% of exact, checked by a test)")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="force an engine, for tests and benchmarks: integer-kernel "
                             "(llmbus's C++ kernels, the fast mode on a CPU), onnxruntime (ONNX "
                             "Runtime's graphs: --exact on a CPU, or the fast mode without a "
                             "compiler), torch (the reference; Triton kernels on CUDA). auto = "
                             "the fastest that runs here for the mode; the executor logs its "
                             "choice as one line (default: auto)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="torch engine: compute dtype of weights and KV cache; bfloat16 "
                             "only on CPUs with native bfloat16 (AVX-512-BF16 or AMX) or CUDA "
                             "(default: float32)")
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
                        help="compute threads (default: all cores)")
    parser.add_argument("--small-step-threads", type=int, default=None,
                        help="torch engine: threads for steps of at most 4 tokens, e.g. "
                             "single-stream decode (default: --threads minus one on machines "
                             "of up to 4 cores, which leaves a core to the other services, else "
                             "--threads)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to keep serving steps while the scheduler "
                             "finishes its requests (default: 30)")


def default_small_step_threads(threads: int) -> int:
    """One core left to the rest of the stack where cores are few (see runner.py)."""
    return max(1, threads - 1) if (os.cpu_count() or 1) <= 4 else threads


def _cuda_available() -> bool:
    """Whether CUDA can run, without importing torch where no NVIDIA driver is present."""
    if not os.path.exists("/proc/driver/nvidia") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return False
    import torch

    return torch.cuda.is_available()


def _record_residency(sequence_id: str, started_ns: int, traceparent: str) -> None:
    """The sequence's time in this executor, as a span of its request's trace (steps link to
    it)."""
    _tracer.start_span("executor.request", context=context_from_traceparent(traceparent),
                       start_time=started_ns,
                       attributes={"llmbus.sequence_id": sequence_id}).end()


def plan_for(args: argparse.Namespace, cuda_available: bool) -> ExecutionPlan:
    """The executor's plan from its options, this machine and the model file."""
    return resolve_plan(resolve_model(args.model), engine=args.engine, exact=args.exact,
                        dtype=args.dtype, device=args.device, cuda_available=cuda_available)


async def main(args: argparse.Namespace) -> None:
    try:
        plan = plan_for(args, cuda_available=args.device == "auto" and _cuda_available())
    except (ValueError, FileNotFoundError) as exc:  # options, file: one line, no traceback
        raise SystemExit(f"llmbus executor: {exc}") from None
    log.info(f"executor plan: {plan.describe()}")
    if plan.engine != "torch":
        configure_openmp()  # before torch loads OpenMP
    async with ServiceRuntime("executor", args.nats_url, args.instance_id) as runtime:
        await _serve(args, runtime, plan)


def _load_runner(args: argparse.Namespace, plan: ExecutionPlan, path: Path) -> ModelRunner:
    """The model and its KV cache (in the forward thread); a file this executor cannot serve
    (an architecture it does not know, a key missing) stops it with one line naming why."""
    from llmbus.services.executor.runner import ModelRunner  # imports torch: after OpenMP
    from llmbus.services.executor.weights.model_config import UnsupportedModelError

    kv_bytes = int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None
    threads = args.threads or os.cpu_count() or 1
    try:
        return ModelRunner(
            path, model_name=model_name_for(path), plan=plan, block_size=args.block_size,
            num_blocks=args.num_blocks, kv_cache_bytes=kv_bytes,
            max_model_len=args.max_model_len, num_threads=threads,
            small_step_threads=args.small_step_threads or default_small_step_threads(threads))
    except UnsupportedModelError as exc:
        raise SystemExit(f"llmbus executor: {path.name}: {exc}") from None


async def _serve_kv_transfers(runtime: ServiceRuntime, runner: ModelRunner,
                              engine_id: str) -> tuple[KvReceiver, KvSender]:
    """Disaggregated prefill (kv_transfer.py): blocks into this cache, and out of it."""
    from llmbus.services.executor.kv_transfer import CHUNK_TIMEOUT_SECONDS, KvReceiver, KvSender

    receiver = KvReceiver(runner.kv_cache)
    assert runtime.nc is not None
    runner.kv_chunk_bytes = runtime.nc.max_payload  # the server's, from its INFO

    async def send_chunk(subject: str, chunk: KvChunk) -> KvReply:
        return await runtime.request(subject, chunk, KvReply, timeout=CHUNK_TIMEOUT_SECONDS)

    async def on_kv_receive(request: KvReceive, _: Msg) -> KvReply:
        return receiver.receive(request)

    async def on_kv(chunk: KvChunk, _: Msg) -> KvReply:
        return receiver.write(chunk)

    await runtime.on_request(subjects.executor_kv_receive(engine_id), KvReceive, on_kv_receive)
    await runtime.on_request(subjects.executor_kv(engine_id), KvChunk, on_kv)
    return receiver, KvSender(send_chunk, subjects.executor_kv)


async def _serve(args: argparse.Namespace, runtime: ServiceRuntime, plan: ExecutionPlan) -> None:
    """Load the model, answer steps until stopped, then linger while the scheduler drains."""
    path = resolve_model(args.model)
    log.info("loading model", path=str(path))
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    loop = asyncio.get_running_loop()
    runner = await loop.run_in_executor(compute, _load_runner, args, plan, path)
    info = runner.info()
    log.info("model loaded", num_blocks=info.num_blocks, max_model_len=info.max_model_len,
             kv_cache_dtype=plan.kv_dtype)

    async def on_info(_: ExecutorInfoRequest, __: Msg) -> ExecutorInfo:
        return info

    # Constraints compile in a thread of their own: never in the forward's, never on the loop.
    compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
    compiler.submit(runner.grammars.warm)

    async def on_grammar(request: GrammarRequest, _: Msg) -> GrammarReply:
        from llmbus.services.structured_output import ConstraintError

        try:
            await loop.run_in_executor(compiler, runner.grammars.prepare, request.structured)
        except ConstraintError as exc:
            return GrammarReply(error=str(exc))
        except Exception as exc:  # a reply, not a scheduler waiting for a time-out
            log.exception("compiling a constraint failed")
            return GrammarReply(error=f"the constraint could not be compiled: {exc}")
        return GrammarReply()

    receiver, sender = await _serve_kv_transfers(runtime, runner, args.engine_id)
    last_reply = time.perf_counter()
    links: dict[str, Link] = {}  # sequence id -> link to its trace, for step spans
    residents: dict[str, tuple[int, str]] = {}  # sequence id -> (registered at, traceparent)

    async def on_step(plan: StepPlan, _: Msg) -> StepResult:
        nonlocal last_reply
        idle = time.perf_counter() - last_reply
        runtime.num_handled += 1
        receiver.close(plan.closed_transfers)  # before this step may reuse their blocks
        for sequence_id in plan.finished_sequence_ids:
            links.pop(sequence_id, None)
            if sequence_id in residents:
                _record_residency(sequence_id, *residents.pop(sequence_id))
        for new in plan.new_requests:
            link = link_to(new.traceparent)
            if link is not None:
                links[new.sequence_id] = link
                residents[new.sequence_id] = (time.time_ns(), new.traceparent)
        # One span per step, serving many requests: linked to each request's trace.
        step_links = [links[s.sequence_id] for s in plan.scheduled if s.sequence_id in links]
        with _tracer.start_as_current_span("executor.step", links=step_links, attributes={
                "llmbus.step_id": plan.step_id, "llmbus.batch_size": len(plan.scheduled),
                "llmbus.num_tokens": sum(s.num_tokens for s in plan.scheduled)}) as span:
            result = await loop.run_in_executor(compute, runner.step, plan)
            span.set_attribute("llmbus.num_sampled", len(result.sampled_token_ids))
            if result.error:
                span.set_status(Status(StatusCode.ERROR, result.error))
            result.transfers = await sender.send_all(*runner.take_kv_outbox())
        result.idle_seconds = idle
        last_reply = time.perf_counter()
        return result

    await runtime.on_request(subjects.executor_info(args.engine_id), ExecutorInfoRequest, on_info)
    await runtime.on_request(subjects.executor_step(args.engine_id), StepPlan, on_step)
    await runtime.on_request(subjects.executor_grammar(args.engine_id), GrammarRequest,
                             on_grammar)
    try:
        await runtime.serve(lambda: Heartbeat(
            service="executor", instance_id=runtime.instance_id, engine_id=args.engine_id,
            num_handled=runtime.num_handled))
        # Keep serving while the scheduler drains: stop after 1 s without a step.
        deadline = time.monotonic() + args.shutdown_timeout
        while time.monotonic() < deadline and time.perf_counter() - last_reply < 1.0:
            await asyncio.sleep(0.1)
    finally:
        compute.shutdown(wait=False)
        compiler.shutdown(wait=False)

"""The executor's bus side: answers the scheduler's step plans with sampled tokens.

The forward runs in a worker thread so that the event loop keeps answering pings while the
model computes: always the same one, since OpenMP gives every thread that starts parallel work
a team of its own, and teams of alternating threads would fight over the cores (2 Zen 4 cores,
one stream: ~15 ms per token with the default pool's threads taking turns, ~11 with one). Steps
of one engine arrive one at a time (the bus hands this handler one message after another).
The exception is a split model's lead, which takes two plans at once, on two threads that
compute one at a time (plan_overlap.py): one plan's hidden states are in the other shards
while the next one's are in the lead's layers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog
from nats.aio.msg import Msg
from opentelemetry.trace import Status, StatusCode

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
from llmbus.services.executor import adapters_bus
from llmbus.services.executor.backend_choice import BackendChoice, choose_backend
from llmbus.services.executor.kernels.cpu.library import configure_openmp
from llmbus.services.executor.options import add_arguments, default_small_step_threads
from llmbus.services.executor.step_traces import StepTraces
from llmbus.services.executor.weights.layer_slice import (
    LayerSlice,
    parse_shard,
    slice_file_bytes,
)
from llmbus.services.executor.weights.matrices import architecture, matrix_types
from llmbus.services.model_files import model_name_for, resolve_model

if TYPE_CHECKING:
    from llmbus.services.executor.runner import ModelRunner

log = structlog.get_logger()

__all__ = ["add_arguments", "backend_choice_for", "main", "serve"]  # the CLI's and tests'


def _cuda_available() -> bool:
    """Whether CUDA can run, without importing torch where no NVIDIA driver is present."""
    if not os.path.exists("/proc/driver/nvidia") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return False
    import torch

    return torch.cuda.is_available()


def backend_choice_for(args: argparse.Namespace, cuda_available: bool) -> BackendChoice:
    """The executor's backend from its options, this machine and the model file."""
    return choose_backend(resolve_model(args.model), backend=args.backend, exact=args.exact,
                          dtype=args.dtype, device=args.device, cuda_available=cuda_available,
                          adapters=adapters_bus.max_adapters(args) > 0)


async def main(args: argparse.Namespace) -> None:
    try:
        choice = backend_choice_for(args,
                                    cuda_available=args.device == "auto" and _cuda_available())
        index, count, layers = parse_shard(args.shard, args.layers, resolve_model(args.model))
        if count > 1 and choice.backend == "encoder":
            raise ValueError("an encoder (BERT's family) runs whole, not in shards")
    except (ValueError, FileNotFoundError) as exc:  # options, file: one line, no traceback
        raise SystemExit(f"llmbus executor: {exc}") from None
    log.info(f"executor backend: {choice.describe()}")
    log.info(f"executor weights: {matrix_types(resolve_model(args.model))}")
    if choice.backend != "torch":
        configure_openmp()  # before torch loads OpenMP
    async with ServiceRuntime("executor", args.nats_url, args.instance_id) as runtime:
        if index > 0:
            from llmbus.services.executor.layer_shard_bus import serve_layer_shard

            assert layers is not None
            await serve_layer_shard(args, runtime, choice, resolve_model(args.model), layers,
                                    index, count, _threads(args), _kv_budget(args, choice.device))
        else:
            await serve(args, runtime, choice, count, layers)


def _threads(args: argparse.Namespace) -> int:
    return args.threads or os.cpu_count() or 1


def _kv_budget(args: argparse.Namespace, device: str) -> int:
    """--kv-cache-memory in bytes, else the default budget of `device` (kv_cache.py's)."""
    if args.kv_cache_memory:
        return int(args.kv_cache_memory * 2**30)
    from llmbus.services.executor.kv_cache import default_budget_bytes

    return default_budget_bytes(device)


def _load_runner(args: argparse.Namespace, choice: BackendChoice, path: Path,
                 layers: LayerSlice | None) -> ModelRunner:
    """The model and its KV cache (in the forward thread); a file this executor cannot serve
    (an architecture it does not know, a key missing) stops it with one line naming why."""
    from llmbus.services.executor.runner import ModelRunner  # imports torch: after OpenMP
    from llmbus.services.executor.weights.model_config import UnsupportedModelError

    kv_bytes = int(args.kv_cache_memory * 2**30) if args.kv_cache_memory else None
    threads = _threads(args)
    try:
        return ModelRunner(
            path, model_name=model_name_for(path), choice=choice, block_size=args.block_size,
            num_blocks=args.num_blocks, kv_cache_bytes=kv_bytes,
            max_model_len=args.max_model_len, num_threads=threads,
            small_step_threads=args.small_step_threads or default_small_step_threads(threads),
            pooling=args.pooling, embed_only=args.task == "embed", layers=layers,
            max_adapters=adapters_bus.max_adapters(args), max_adapter_rank=args.max_lora_rank)
    except (UnsupportedModelError, ValueError) as exc:  # the file, or options it cannot take
        raise SystemExit(f"llmbus executor: {path.name}: {exc}") from None


async def serve(args: argparse.Namespace, runtime: ServiceRuntime, choice: BackendChoice,
                num_shards: int = 1, layers: LayerSlice | None = None) -> None:
    """Load the model (the lead shard's layers: then find the others), answer steps until
    stopped, then linger while the scheduler drains."""
    path = resolve_model(args.model)
    log.info("loading model", path=str(path))
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    try:
        runner = await asyncio.get_running_loop().run_in_executor(
            compute, _load_runner, args, choice, path, layers)
        if num_shards > 1:
            from llmbus.services.executor.pipeline_lead_bus import PipelineLead

            assert layers is not None
            await PipelineLead(runtime, args.engine_id, num_shards, args.shard_timeout
                               ).connect(runner, str(path), layers)
        service = ExecutorService(runtime, runner, args.engine_id, compute, num_shards)
        adapters = adapters_bus.ExecutorAdapters(runtime, runner, args.engine_id, compute,
                                                 architecture(path))
        await adapters.start(args.lora)
    except BaseException:
        compute.shutdown(wait=False)  # the forward thread of a model that never served
        raise
    log.info("model loaded", num_blocks=service.info.num_blocks,
             max_model_len=service.info.max_model_len, kv_cache_dtype=choice.kv_dtype,
             weight_mib=round((path.stat().st_size if layers is None
                               else slice_file_bytes(path, layers)) / 2**20),
             kv_mib=round(runner.kv_cache.k.nbytes * 2 / 2**20))
    try:
        await service.subscribe()
        await runtime.serve(lambda: Heartbeat(
            service="executor", instance_id=runtime.instance_id, engine_id=args.engine_id,
            num_handled=runtime.num_handled, adapters=adapters.names()))
        await service.linger(args.shutdown_timeout)
    finally:
        service.close()


class ExecutorService:
    """The executor stage's handlers over one ModelRunner: steps, its cache geometry,
    constraints compiled ahead of a request's first step, and KV blocks of disaggregated
    prefills in and out (kv_transfer.py). Every runner call that computes runs in `compute`,
    the one forward thread; constraints compile in a thread of their own, never in the
    forward's and never on the event loop."""

    def __init__(self, runtime: ServiceRuntime, runner: ModelRunner, engine_id: str,
                 compute: ThreadPoolExecutor, num_shards: int = 1) -> None:
        from llmbus.services.executor.kv_transfer import (  # imports torch: after OpenMP
            CHUNK_TIMEOUT_SECONDS,
            KvReceiver,
            KvSender,
        )

        self.runtime, self.runner, self.engine_id = runtime, runner, engine_id
        self.compute = compute
        # A split model's lead takes the next plan while one is in its other shards: two
        # threads, in the runner's turns (plan_overlap.py); else every step in `compute`.
        self.overlap = (ThreadPoolExecutor(max_workers=2, thread_name_prefix="plan")
                        if runner.turns is not None else None)
        self.compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.info = msgspec.structs.replace(runner.info(), num_shards=num_shards)
        self.traces = StepTraces()
        self.receiver = KvReceiver(runner.kv_cache)
        self.sender = KvSender(self._send_chunk, subjects.executor_kv)
        self.chunk_timeout = CHUNK_TIMEOUT_SECONDS
        self.last_reply = time.perf_counter()
        self.running = 0  # plans being computed (two at once on a split model's lead)

    async def subscribe(self) -> None:
        runtime, engine_id = self.runtime, self.engine_id
        self.compiler.submit(self.runner.grammars.warm)
        self.runner.on_progress = runtime.thread_publisher(subjects.executor_progress(engine_id))
        assert runtime.nc is not None
        self.runner.kv_gathering.chunk_bytes = runtime.nc.max_payload  # the server's INFO's
        await runtime.on_request(subjects.executor_kv_receive(engine_id), KvReceive,
                                 self.on_kv_receive)
        await runtime.on_request(subjects.executor_kv(engine_id), KvChunk, self.on_kv)
        await runtime.on_request(subjects.executor_info(engine_id), ExecutorInfoRequest,
                                 self.on_info)
        await runtime.on_request(subjects.executor_step(engine_id), StepPlan, self.on_step,
                                 concurrency=1 if self.overlap is None else 2)
        await runtime.on_request(subjects.executor_grammar(engine_id), GrammarRequest,
                                 self.on_grammar)

    async def on_step(self, plan: StepPlan, _: Msg) -> StepResult:
        # (a split model's lead: no wait for this plan while another one runs)
        idle = 0.0 if self.running else time.perf_counter() - self.last_reply
        self.running += 1
        try:
            return await self._step(plan, idle)
        finally:
            self.running -= 1

    async def _step(self, plan: StepPlan, idle: float) -> StepResult:
        self.runtime.num_handled += 1
        self.receiver.close(plan.closed_transfers)  # before this step may reuse their blocks
        turns = self.runner.turns
        ticket = turns.ticket() if turns is not None else None  # in arrival order
        with self.traces.step_span(plan) as span:
            outcome = await asyncio.get_running_loop().run_in_executor(  # the span current
                self.overlap or self.compute, contextvars.copy_context().run,
                self.runner.execute, plan, ticket)
            span.set_attribute("llmbus.num_sampled", len(outcome.sampled.token_ids))
            if outcome.error:
                span.set_status(Status(StatusCode.ERROR, outcome.error))
            transfers = await self.sender.send_all(*self.runner.kv_gathering.take())
        self.last_reply = time.perf_counter()
        return outcome.result(idle_seconds=idle, transfers=transfers)

    async def on_info(self, _: ExecutorInfoRequest, __: Msg) -> ExecutorInfo:
        return self.info

    async def on_grammar(self, request: GrammarRequest, _: Msg) -> GrammarReply:
        from llmbus.services.structured_output import ConstraintError

        try:
            await asyncio.get_running_loop().run_in_executor(
                self.compiler, self.runner.grammars.prepare, request.structured)
        except ConstraintError as exc:
            return GrammarReply(error=str(exc))
        except Exception as exc:  # a reply, not a scheduler waiting for a time-out
            log.exception("compiling a constraint failed")
            return GrammarReply(error=f"the constraint could not be compiled: {exc}")
        return GrammarReply()

    async def on_kv_receive(self, request: KvReceive, _: Msg) -> KvReply:
        return self.receiver.receive(request)

    async def on_kv(self, chunk: KvChunk, _: Msg) -> KvReply:
        return self.receiver.write(chunk)

    async def _send_chunk(self, subject: str, chunk: KvChunk) -> KvReply:
        return await self.runtime.request(subject, chunk, KvReply, timeout=self.chunk_timeout)

    async def linger(self, timeout: float) -> None:
        """Keep serving while the scheduler drains: return after 1 s without a step, or after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and time.perf_counter() - self.last_reply < 1.0:
            await asyncio.sleep(0.1)

    def close(self) -> None:
        self.compute.shutdown(wait=False)
        self.compiler.shutdown(wait=False)
        if self.overlap is not None:
            self.overlap.shutdown(wait=False)

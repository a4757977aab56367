"""A layer shard's bus side: answers its lead shard's info, setup and steps.

Imported once OpenMP is configured (it imports torch). The forward runs in one worker thread
(as the executor's: service.py says why), so that the event loop keeps answering pings and
heartbeating while the layers compute. Steps come one at a time, and a step's parts in order:
the lead waits for each answer before it sends more.
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import structlog
from nats.aio.msg import Msg
from opentelemetry import trace

from llmbus.bus import subjects
from llmbus.bus.messages import (
    NOT_SET_UP,
    Heartbeat,
    ShardFetch,
    ShardHidden,
    ShardInfo,
    ShardInfoRequest,
    ShardSetup,
    ShardStep,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.executor.backend_choice import BackendChoice
from llmbus.services.executor.hidden_handoff import (
    ENVELOPE_BYTES,
    hidden_from_parts,
    hidden_parts,
)
from llmbus.services.executor.layer_shard import LayerShard
from llmbus.services.executor.weights.layer_slice import LayerSlice

log = structlog.get_logger()
_tracer = trace.get_tracer("llmbus.executor")  # a shard step: a child of its lead's step


class LayerShardService:
    """The handlers over one LayerShard; every call that computes runs in `compute`."""

    def __init__(self, runtime: ServiceRuntime, shard: LayerShard, engine_id: str, index: int,
                 compute: ThreadPoolExecutor) -> None:
        self.runtime, self.shard, self.compute = runtime, shard, compute
        self.engine_id, self.index = engine_id, index
        self._incoming: list[bytes] = []  # parts of the step under way
        self._first: ShardStep | None = None  # its first part: the geometry
        self._outgoing: tuple[int, list[bytes]] = (-1, [])  # the last step's output parts

    async def subscribe(self) -> None:
        for what, message_type, handler in (("info", ShardInfoRequest, self.on_info),
                                            ("setup", ShardSetup, self.on_setup),
                                            ("step", ShardStep, self.on_step),
                                            ("fetch", ShardFetch, self.on_fetch)):
            await self.runtime.on_request(subjects.executor_shard(self.engine_id, self.index,
                                                                  what),
                                          message_type, handler)  # type: ignore[arg-type]

    async def on_info(self, _: ShardInfoRequest, __: Msg) -> ShardInfo:
        return self.shard.info()

    async def on_setup(self, setup: ShardSetup, _: Msg) -> ShardInfo:
        try:
            await asyncio.get_running_loop().run_in_executor(self.compute, self.shard.setup,
                                                             setup)
        except (RuntimeError, ValueError) as exc:  # no memory for the cache, a bad geometry
            return msgspec.structs.replace(self.shard.info(),
                                           error=f"{type(exc).__name__}: {exc}")
        info = self.shard.info()
        log.info(f"executor shard {self.index}: set up by its lead", num_blocks=setup.num_blocks,
                 kv_bytes=info.kv_bytes)
        return info

    async def on_step(self, part: ShardStep, _: Msg) -> ShardHidden:
        if part.part == 0:
            self._first, self._incoming = part, []
        elif self._first is None or part.step_id != self._first.step_id:
            return ShardHidden(error=f"part {part.part} of step {part.step_id} without its "
                                     "first part")
        if self.shard.kv_cache is None:
            return ShardHidden(error=NOT_SET_UP)
        self._incoming.append(part.hidden)
        if len(self._incoming) < part.num_parts:
            return ShardHidden()
        first, self._first = self._first, None
        assert first is not None
        self.runtime.num_handled += 1
        try:
            hidden = hidden_from_parts(self._incoming, self.shard.model.config.hidden_size,
                                       first.dtype)
            with _tracer.start_as_current_span("executor.shard_step", attributes={
                    "llmbus.shard": self.index, "llmbus.num_tokens": first.num_tokens}):
                out = await asyncio.get_running_loop().run_in_executor(
                    self.compute, self.shard.run, first, hidden)
        except Exception as exc:  # an answer, not a lead waiting for its time-out
            log.exception("a shard step failed", step_id=part.step_id)
            return ShardHidden(error=f"{type(exc).__name__}: {exc}")
        assert self.runtime.nc is not None
        parts = hidden_parts(out, self.runtime.nc.max_payload - ENVELOPE_BYTES)
        self._outgoing = (part.step_id, parts)
        return ShardHidden(part=0, num_parts=len(parts), hidden=parts[0])

    async def on_fetch(self, fetch: ShardFetch, _: Msg) -> ShardHidden:
        step_id, parts = self._outgoing
        if fetch.step_id != step_id or not 0 <= fetch.part < len(parts):
            return ShardHidden(error=f"no part {fetch.part} of step {fetch.step_id} here")
        return ShardHidden(part=fetch.part, num_parts=len(parts), hidden=parts[fetch.part])


async def serve_layer_shard(args: argparse.Namespace, runtime: ServiceRuntime,
                            choice: BackendChoice, path: Path, layers: LayerSlice, index: int,
                            count: int, threads: int, kv_budget_bytes: int) -> None:
    """Load the shard's layers, then answer its lead until stopped."""
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
    try:
        shard = await asyncio.get_running_loop().run_in_executor(
            compute, LayerShard, path, choice, layers, threads, kv_budget_bytes)
        service = LayerShardService(runtime, shard, args.engine_id, index, compute)
        await service.subscribe()
        log.info(f"executor shard {index}/{count} of engine {args.engine_id}: "
                 f"{layers.describe()}, {shard.info().weight_bytes / 2**20:.0f} MiB of "
                 "weights; waiting for its lead")
        await runtime.serve(lambda: Heartbeat(
            service="executor", instance_id=runtime.instance_id, engine_id=args.engine_id,
            num_handled=runtime.num_handled, shard=f"{index}/{count}"))
    finally:
        compute.shutdown(wait=False)


"""The lead shard's side of a model split by layers: find the layer shards, check that they
make up the model, size their caches, and carry each step's hidden states through them.

The lead (shard 0) is the engine's executor as its scheduler sees it: it takes the plans, keeps
the requests, embeds, and samples. Between its own layers and its head, its forward
(pipeline_lead.PipelinedForward) calls `send` for each micro-batch of the step: the residual
stream goes to shard 1, its output to shard 2, and so on, each hop a request/reply on the bus
(ShardStep, split under max_payload, ShardFetch for a long answer's other parts), while the
forward thread computes the next micro-batch's first layers.

A shard that stops answering ends the lead: the engine is then dead by the scheduler's
heartbeat rules, and its requests move to another engine (or wait for a restart), as for any
executor that dies. Imported once OpenMP is configured (it imports torch).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import msgspec
import structlog
import torch
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from llmbus.bus import subjects
from llmbus.bus.codec import encode
from llmbus.bus.liveness import DEAD_AFTER, HEARTBEAT_INTERVAL, Liveness
from llmbus.bus.messages import (
    NOT_SET_UP,
    BlockCopy,
    Heartbeat,
    ShardFetch,
    ShardHidden,
    ShardInfo,
    ShardInfoRequest,
    ShardSetup,
    ShardStep,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.executor.hidden_handoff import (
    ENVELOPE_BYTES,
    Geometry,
    hidden_from_parts,
    hidden_parts,
)
from llmbus.services.executor.pipeline_lead import PipelinedForward
from llmbus.services.executor.plan_overlap import LeadTurns
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.weights.layer_slice import (
    LayerSlice,
    model_layers,
    slice_file_bytes,
)
from llmbus.services.model_files import model_name_for

log = structlog.get_logger()

FIND_PROGRESS_SECONDS = 10.0  # a line while shards are still loading


class ShardLost(RuntimeError):
    """A layer shard did not answer a step, or lost its KV cache (it started again)."""


def check_shards(lead: ShardInfo, shards: list[ShardInfo], count: int) -> str:
    """Why `shards` (1..count-1, in order) and `lead` do not make up one model; ""."""
    end = lead.end_layer
    for index, shard in enumerate(shards, start=1):
        name = f"shard {index}/{count}"
        if (shard.model_name, shard.model_bytes) != (lead.model_name, lead.model_bytes):
            return (f"{name} serves {shard.model_name} ({shard.model_bytes} bytes), the lead "
                    f"{lead.model_name} ({lead.model_bytes} bytes)")
        if shard.kv_dtype != lead.kv_dtype:
            return (f"{name} keeps its KV cache in {shard.kv_dtype}, the lead in "
                    f"{lead.kv_dtype} (are both --exact, or neither?)")
        if shard.first_layer != end:
            what = "overlap" if shard.first_layer < end else "leave out layers"
            return (f"{name} holds layers {shard.first_layer}:{shard.end_layer}, but the "
                    f"shards before it end at layer {end}: they {what}")
        end = shard.end_layer
    if end != lead.num_model_layers:
        return f"the shards end at layer {end} of the model's {lead.num_model_layers}"
    return ""


class PipelineLead:
    """`connect` once (finds and sets up the shards), then `send` every micro-batch."""

    def __init__(self, runtime: ServiceRuntime, engine_id: str, count: int,
                 step_timeout: float) -> None:
        self.runtime, self.engine_id, self.count = runtime, engine_id, count
        self.step_timeout = step_timeout
        self.loop = asyncio.get_running_loop()
        self.copies: list[BlockCopy] = []  # the runner's, for the next step's first hop
        self.hidden_size = 0
        self.step_id = 0
        self.shards_heard = Liveness()  # by instance; the index each beats for in `shard`
        self.hop_locks = {index: asyncio.Lock() for index in range(1, count)}
        self.connected_at = 0.0

    def _subject(self, index: int, what: str) -> str:
        return subjects.executor_shard(self.engine_id, index, what)

    async def _find(self, index: int) -> ShardInfo:
        """Shard `index`'s info, once it has loaded and answers (a line every few seconds)."""
        started = last_line = time.monotonic()
        while True:
            try:
                return await self.runtime.request(self._subject(index, "info"),
                                                  ShardInfoRequest(), ShardInfo, timeout=2.0)
            except (NatsError, TimeoutError):
                if time.monotonic() - last_line >= FIND_PROGRESS_SECONDS:
                    last_line = time.monotonic()
                    log.info(f"executor: waiting for shard {index}/{self.count} of engine "
                             f"{self.engine_id} ({last_line - started:.0f} s)")
                await asyncio.sleep(0.5)

    async def connect(self, runner: ModelRunner, model_path: str, layers: LayerSlice) -> None:
        """Find every shard, check them against this lead, give all one KV geometry (as many
        blocks as the smallest holds), and take the runner's forward through them. Exits
        with one line when the shards do not make up the model."""
        config, choice = runner.config, runner.choice
        kv = runner.kv_cache
        lead = ShardInfo(model_name=model_name_for(Path(model_path)),
                         model_bytes=os.path.getsize(model_path),
                         num_model_layers=model_layers(model_path), first_layer=0,
                         end_layer=layers.end, backend=choice.describe(),
                         kv_dtype=choice.kv_dtype, kv_budget_bytes=0, kv_token_bytes=0,
                         weight_bytes=slice_file_bytes(model_path, layers))
        await self.runtime.on_message(subjects.heartbeat("executor"), Heartbeat,
                                      self._on_heartbeat)
        shards = [await self._find(index) for index in range(1, self.count)]
        problem = check_shards(lead, shards, self.count)
        if problem:
            raise SystemExit(f"llmbus executor: engine {self.engine_id}'s shards do not make "
                             f"up one model: {problem}")
        block_size = runner.block_size
        num_blocks = min([kv.num_blocks] + [s.kv_budget_bytes // (s.kv_token_bytes * block_size)
                                            for s in shards])
        if num_blocks < kv.num_blocks:
            runner.set_num_blocks(num_blocks)
        setup = ShardSetup(num_blocks=num_blocks, block_size=block_size,
                           max_model_len=runner.max_model_len)
        self.hidden_size = config.hidden_size
        token_bytes = config.hidden_size * torch.empty(0, dtype=runner.model.dtype).element_size()
        kv_bytes = runner.kv_cache.k.nbytes * 2
        log.info(f"executor shard 0/{self.count}: {layers.describe()}, "
                 f"{lead.weight_bytes / 2**20:.0f} MiB of weights, {kv_bytes / 2**20:.0f} MiB "
                 f"of KV ({num_blocks} blocks); sends {token_bytes} bytes a token to each "
                 "other shard and back")
        for index in range(1, self.count):
            info = await self.runtime.request(self._subject(index, "setup"), setup, ShardInfo,
                                              timeout=60.0)
            if info.error:
                raise SystemExit(f"llmbus executor: shard {index}/{self.count} could not set "
                                 f"up its KV cache: {info.error}")
            log.info(f"executor shard {index}/{self.count}: layers {info.first_layer}:"
                     f"{info.end_layer}, {info.backend}, {info.weight_bytes / 2**20:.0f} MiB "
                     f"of weights, {info.kv_bytes / 2**20:.0f} MiB of KV")
        self.connected_at = self.runtime.bus_time()
        runner.copies_for_shards = self.copies
        # The next plan computes here while this one is in the other shards; not with LoRA
        # adapters, whose slots a step's forward sets for its own requests.
        runner.turns = LeadTurns() if runner.adapters is None else None
        runner.model_forward = PipelinedForward(runner.model, self.send, self.count,
                                                turns=runner.turns)

    async def _on_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        if heartbeat.engine_id == self.engine_id and heartbeat.shard:
            self.shards_heard.seen(heartbeat, self.runtime.bus_time())

    def _silent(self, index: int) -> bool:
        """Whether no copy of shard `index` has beaten for DEAD_AFTER (the heartbeat rule
        every stage judges its peers by)."""
        now = self.runtime.bus_time()
        if now - self.connected_at <= DEAD_AFTER:  # its first beats may still be coming
            return False
        return not any(h.shard == f"{index}/{self.count}" for h in self.shards_heard.alive(now))

    def send(self, hidden: torch.Tensor, geometry: Geometry) -> Future[torch.Tensor]:
        """From the forward thread: hidden [T, D] of a micro-batch after the lead's layers ->
        a future of it after the last shard's (PipelinedForward's `send`). The step's block
        copies go with its first micro-batch."""
        copies, self.copies[:] = list(self.copies), []
        # The task takes this thread's context, the step's span current (service.on_step):
        # the hops carry it, and each shard's span is its child.
        return asyncio.run_coroutine_threadsafe(
            self._through_shards(hidden.cpu(), geometry, copies), self.loop)

    async def _through_shards(self, hidden: torch.Tensor, geometry: Geometry,
                              copies: list[BlockCopy]) -> torch.Tensor:
        """Each shard in turn, one micro-batch at a time per shard (their order is the step's:
        a later one may attend to an earlier one's keys). A shard lost ends this process."""
        self.step_id += 1
        query_lens, context_lens, tables = geometry
        dtype = str(hidden.dtype).removeprefix("torch.")
        try:
            for index in range(1, self.count):
                first = ShardStep(step_id=self.step_id, part=0, num_parts=1, hidden=b"",
                                  dtype=dtype, num_tokens=hidden.shape[0],
                                  query_lens=query_lens, context_lens=context_lens,
                                  block_tables=tables, copy_blocks=copies)
                async with self.hop_locks[index]:
                    hidden = await self._hop(index, first, hidden)
        except ShardLost as exc:
            log.error(f"executor: {exc}; exiting, so that engine {self.engine_id}'s requests "
                      "move on")
            sys.stdout.flush()
            os._exit(1)
        return hidden

    async def _hop(self, index: int, first: ShardStep, hidden: torch.Tensor) -> torch.Tensor:
        """One shard's layers on `hidden`: its parts out, its answer's parts back."""
        assert self.runtime.nc is not None
        room = self.runtime.nc.max_payload - ENVELOPE_BYTES - len(encode(first))
        parts = hidden_parts(hidden, room)
        answer = ShardHidden()
        for number, data in enumerate(parts):
            fields = first if number == 0 else ShardStep(step_id=first.step_id, part=number,
                                                         num_parts=0, hidden=b"")
            answer = await self._ask(index, "step", msgspec.structs.replace(
                fields, num_parts=len(parts), hidden=data))
        out = [answer.hidden]
        for number in range(1, answer.num_parts):
            out.append((await self._ask(index, "fetch", ShardFetch(
                step_id=first.step_id, part=number))).hidden)
        return hidden_from_parts(out, self.hidden_size, first.dtype)

    async def _ask(self, index: int, what: str, message: ShardStep | ShardFetch) -> ShardHidden:
        """The shard's answer; ShardLost when it cannot come: nobody listens, the step
        timed out, or the shard went silent meanwhile (a process killed mid-step)."""
        asking = asyncio.ensure_future(self.runtime.request(
            self._subject(index, what), message, ShardHidden, timeout=self.step_timeout))
        try:
            while not (await asyncio.wait({asking}, timeout=HEARTBEAT_INTERVAL))[0]:
                if self._silent(index):
                    raise ShardLost(f"shard {index}/{self.count} of engine {self.engine_id} "
                                    "went silent during a step")
            answer = asking.result()
        except (NatsError, TimeoutError) as exc:
            raise ShardLost(f"shard {index}/{self.count} of engine {self.engine_id} did not "
                            f"answer a step ({type(exc).__name__})") from exc
        finally:
            asking.cancel()
        if answer.error == NOT_SET_UP:
            raise ShardLost(f"shard {index}/{self.count} of engine {self.engine_id} started "
                            "again: the KV cache of its layers is gone")
        if answer.error:
            raise RuntimeError(f"shard {index}/{self.count}: {answer.error}")
        return answer


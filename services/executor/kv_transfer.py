"""Disaggregated prefill, the executors' part on the bus: KV blocks moved from a prefill
engine's cache into a decode engine's.

The prefill executor gathers a sequence's blocks as they fill (kv_gathering.py, in the forward
thread, right after the step that wrote them and before a later step can reuse them) and sends
them in chunks no bigger than the server's max_payload (`KvSender`), a few in flight at once:
each is a request whose answer says the decode executor wrote it, so a slow or gone receiver
holds the sender back instead of the bus buffering it. The transfer's last blocks are
acknowledged before the prefill's step is answered, so when the prefill engine says "done" the
KV is in place.

The decode executor writes only blocks of a transfer its scheduler opened (`KvReceiver`) and
stops taking them once the scheduler closes it (before those blocks can go to anyone else), so
a late chunk of a try given up never lands in another request's blocks.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from llmbus.bus.messages import (
    KvChunk,
    KvReceive,
    KvReply,
    KvTransferReport,
)
from llmbus.bus.tracing import context_from_traceparent
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.kv_gathering import Outgoing, layout_of

_tracer = trace.get_tracer("llmbus.executor")
IN_FLIGHT = 4  # chunks sent and not yet acknowledged, per executor
CHUNK_TIMEOUT_SECONDS = 10.0
RECENTLY_CLOSED = 4096  # transfer ids a receiver remembers closing (a late open is refused)


class KvReceiver:
    """The decode executor's side: open transfers and the blocks each may write."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.layout = layout_of(cache)
        self.open: dict[str, set[int]] = {}
        self._closed: dict[str, None] = {}  # the latest closed, oldest first

    def receive(self, request: KvReceive) -> KvReply:
        mismatch = self.layout.mismatch(request.layout, theirs="the transfer's")
        if mismatch:
            return KvReply(error=mismatch)
        if any(not 0 < b < self.cache.num_blocks for b in request.block_ids):
            return KvReply(error="block ids outside the cache (or the null block)")
        if request.transfer_id in self._closed:  # its opening came after its close
            return KvReply(error=f"transfer {request.transfer_id} was closed")
        blocks = set(request.block_ids)
        # The scheduler gave these blocks to this transfer: any other still open on them was
        # given up (its close not here yet) and must not write into them any more.
        self.close([t for t, held in self.open.items() if held & blocks])
        self.open[request.transfer_id] = blocks
        return KvReply()

    def close(self, transfer_ids: list[str]) -> None:
        for transfer_id in transfer_ids:
            self.open.pop(transfer_id, None)
            self._closed[transfer_id] = None
        while len(self._closed) > RECENTLY_CLOSED:
            del self._closed[next(iter(self._closed))]

    def write(self, chunk: KvChunk) -> KvReply:
        allowed = self.open.get(chunk.transfer_id)
        if allowed is None:
            return KvReply(error=f"transfer {chunk.transfer_id} is not open here")
        if not allowed.issuperset(chunk.block_ids):
            return KvReply(error=f"transfer {chunk.transfer_id}: blocks outside it")
        k_cache, v_cache = self.cache.k, self.cache.v
        shape = (chunk.num_layers, len(chunk.block_ids), *k_cache.shape[2:])
        expected = k_cache.element_size() * shape[0] * shape[1] * k_cache[0, 0].numel()
        if len(chunk.k) != expected or len(chunk.v) != expected:
            return KvReply(error=f"transfer {chunk.transfer_id}: a chunk of {len(chunk.k)} "
                                 f"bytes, expected {expected}")
        layers = slice(chunk.first_layer, chunk.first_layer + chunk.num_layers)
        for cache, data in ((k_cache, chunk.k), (v_cache, chunk.v)):
            _write(cache, layers, chunk.block_ids, data, shape)
        return KvReply()


def _write(cache: torch.Tensor, layers: slice, block_ids: list[int], data: bytes,
           shape: tuple[int, ...]) -> None:
    """cache[layers, block_ids] = data. On a CPU through numpy: this runs on the executor's
    event loop, beside the forward thread, and a parallel torch op here would start a second
    OpenMP team on the forward's cores (the service keeps torch's work on one thread for that
    reason)."""
    if cache.device.type == "cpu" and cache.dtype != torch.bfloat16:
        target = cache.numpy()
        target[layers, block_ids] = np.frombuffer(data, dtype=target.dtype).reshape(shape)
        return
    index = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    with warnings.catch_warnings():  # a read-only buffer: only read from
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(data, dtype=torch.uint8).view(cache.dtype)
    cache[layers, index] = values.view(shape).to(cache.device)


@dataclass
class _Sending:
    """One transfer under way. `busy_seconds`: while any of its chunks was in flight (what
    it cost the bus; most of it hides behind the prefill's later chunks)."""

    traceparent: str
    started_ns: int
    num_bytes: int = 0
    tasks: list[asyncio.Task] = field(default_factory=list)
    error: str = ""
    in_flight: int = 0
    busy_since: float = 0.0
    busy_seconds: float = 0.0


class KvSender:
    """The prefill executor's side: chunks out, a few in flight, each acknowledged."""

    def __init__(self, send: Callable[[str, KvChunk], Awaitable[KvReply]],
                 subject_for: Callable[[str], str], in_flight: int = IN_FLIGHT) -> None:
        self._send, self._subject_for, self._in_flight = send, subject_for, in_flight
        # Per decode engine: a slow or hung one holds back only its own transfers.
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._sending: dict[str, _Sending] = {}
        self._failed: list[KvTransferReport] = []

    async def send_all(self, outbox: list[Outgoing],
                       dropped: list[str] = ()) -> list[KvTransferReport]:
        """A step's gathered blocks: sent while the next step computes, except a prefill's
        last ones, which are acknowledged before its step (and first token) is answered.
        `dropped`: transfers whose requests ended here (no more of them is sent). Returns
        the transfers that ended: those finished, and those that failed."""
        for transfer_id in dropped:
            self.cancel(transfer_id)
        for outgoing in outbox:
            self.send(outgoing)
        reports = self.take_failed()
        for outgoing in outbox:
            if outgoing.final:
                started = time.perf_counter()
                report = await self.finish(outgoing.destination.transfer_id)
                report.wait_seconds = time.perf_counter() - started
                reports.append(report)
        return reports

    def send(self, outgoing: Outgoing) -> None:
        transfer_id = outgoing.destination.transfer_id
        state = self._sending.get(transfer_id)
        if state is None:
            state = self._sending[transfer_id] = _Sending(outgoing.traceparent, time.time_ns())
        subject = self._subject_for(outgoing.destination.engine_id)
        slots = self._slots.setdefault(subject, asyncio.Semaphore(self._in_flight))
        for chunk in outgoing.chunks:
            state.tasks.append(asyncio.create_task(self._one(state, subject, chunk, slots)))

    def cancel(self, transfer_id: str) -> None:
        """Its request ended here (aborted): send no more of it, and forget it."""
        state = self._sending.pop(transfer_id, None)
        if state is not None:
            state.error = "cancelled"

    async def _one(self, state: _Sending, subject: str, chunk: KvChunk,
                   slots: asyncio.Semaphore) -> None:
        async with slots:
            if state.error:
                return  # the transfer failed already: send no more of it
            if not state.in_flight:
                state.busy_since = time.perf_counter()
            state.in_flight += 1
            try:
                reply = await self._send(subject, chunk)
            except Exception as exc:  # gone, or too slow: the transfer fails
                state.error = state.error or f"{type(exc).__name__}: {exc}".rstrip(": ")
                return
            finally:
                state.in_flight -= 1
                if not state.in_flight:
                    state.busy_seconds += time.perf_counter() - state.busy_since
            if reply.error:
                state.error = state.error or reply.error
            else:
                state.num_bytes += len(chunk.k) + len(chunk.v)

    async def finish(self, transfer_id: str) -> KvTransferReport:
        """Wait until every chunk of the transfer is acknowledged (or it failed)."""
        state = self._sending.pop(transfer_id, None)
        if state is None:
            return KvTransferReport(transfer_id=transfer_id)
        await asyncio.gather(*state.tasks)
        span = _tracer.start_span(  # from its first chunk sent to its last acknowledged
            "executor.kv_transfer", context=context_from_traceparent(state.traceparent),
            start_time=state.started_ns, attributes={
                "llmbus.transfer_id": transfer_id, "llmbus.num_bytes": state.num_bytes,
                "llmbus.busy_seconds": state.busy_seconds})
        if state.error:
            span.set_status(Status(StatusCode.ERROR, state.error))
        span.end()
        return KvTransferReport(transfer_id=transfer_id, num_bytes=state.num_bytes,
                                seconds=state.busy_seconds,
                                error=state.error)

    def take_failed(self) -> list[KvTransferReport]:
        """Transfers that failed before their last step (the prefill engine stops them)."""
        failed = [t for t, s in self._sending.items() if s.error]
        return [KvTransferReport(transfer_id=t, error=self._sending.pop(t).error)
                for t in failed]

"""The executor's LoRA adapters over the bus: prepared on request, from the bus's adapter store.

Who asks: the scheduler, when it admits a request for an adapter (on this engine's subject,
like a grammar compiled ahead: the request is scheduled only once its adapter is known here,
and refused if it cannot be), and the api, when a client loads or unloads one (on the subject
every executor hears). Both get one AdapterReply. The bytes come from the adapter store
(adapter_store_bus.py), never from a path: the api that loaded the adapter may run on another
host. Adapters named with `--lora` at start are checked against the model, put into the store
and prepared before the executor answers anything, so a misfit stops it with one line.

Parsing runs off the event loop; the slot table changes only on the forward thread, between
steps (lora/adapter_slots.py).
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from nats.aio.msg import Msg

from llmbus.bus import subjects
from llmbus.bus.messages import AdapterCommand, AdapterReply
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.adapter_files import pack_adapter
from llmbus.services.adapter_store_bus import AdapterStore, AdapterStoreUnavailable

if TYPE_CHECKING:
    from llmbus.services.executor.runner import ModelRunner

log = structlog.get_logger()


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters: a request's `model` may name one, loaded "
                             "at start (--lora) or at run time (POST /v1/load_lora_adapter). "
                             "On a CPU in the exact mode they run on the torch backend")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                        help="an adapter to serve as model NAME: a PEFT folder "
                             "(adapter_config.json + adapter_model.safetensors) or a llama.cpp "
                             "GGUF adapter; repeatable; implies --enable-lora")
    parser.add_argument("--max-loras", type=int, default=4, metavar="N",
                        help="adapters one step may mix; more are kept on the host and swapped "
                             "in, least recently used first (default: 4)")
    parser.add_argument("--max-lora-rank", type=int, default=64,
                        help="the largest adapter rank taken (default: 64)")


def max_adapters(args: argparse.Namespace) -> int:
    """The executor's adapter slots from its options: 0 where adapters are off."""
    return args.max_loras if args.enable_lora or args.lora else 0


def parse_lora_option(value: str) -> tuple[str, Path]:
    """`--lora NAME=PATH` -> (name, path); ValueError naming what is wrong."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora {value!r}: expected NAME=PATH (a PEFT folder or a GGUF "
                         "adapter)")
    return name, Path(path)


class ExecutorAdapters:
    """Answers AdapterCommands for one executor; `store` None: it serves no adapters."""

    def __init__(self, runtime: ServiceRuntime, runner: ModelRunner, engine_id: str,
                 compute: ThreadPoolExecutor, architecture: str) -> None:
        self.runtime, self.runner, self.engine_id = runtime, runner, engine_id
        self.compute, self.architecture = compute, architecture
        self.store: AdapterStore | None = None
        self._preparing: dict[str, asyncio.Future[str]] = {}  # one fetch per name at a time

    async def start(self, at_start: list[str]) -> None:
        """Open the store, put and prepare the `--lora` adapters, then take commands."""
        if self.runner.adapters is not None:
            try:
                self.store = await AdapterStore.open(self.runtime)
            except AdapterStoreUnavailable as exc:
                raise SystemExit(f"llmbus executor: adapters live in the bus's store: {exc}"
                                 ) from None
            for option in at_start:
                await self._load_at_start(*parse_lora_option(option))
        await self.runtime.on_request(subjects.EXECUTOR_ADAPTERS, AdapterCommand,
                                      self.on_command, concurrency=8)
        await self.runtime.on_request(subjects.executor_adapter(self.engine_id),
                                      AdapterCommand, self.on_command, concurrency=8)

    async def _load_at_start(self, name: str, path: Path) -> None:
        assert self.store is not None
        try:
            blob = await asyncio.to_thread(pack_adapter, path)
            problem = await self._prepare_blob(name, blob)
        except (OSError, ValueError) as exc:
            problem = str(exc)
        if problem:
            raise SystemExit(f"llmbus executor: --lora {name}={path}: {problem}")
        await self.store.put(name, blob)
        log.info("adapter loaded", adapter=name, path=str(path))

    def names(self) -> list[str]:
        """The adapters this executor holds (its heartbeat's)."""
        return sorted(self.runner.adapters.known) if self.runner.adapters is not None else []

    async def on_command(self, command: AdapterCommand, _: Msg) -> AdapterReply:
        adapters = self.runner.adapters
        if adapters is None:
            return AdapterReply(engine_id=self.engine_id, enabled=False)
        if command.action == "unload":  # on the forward thread, between two steps
            await asyncio.get_running_loop().run_in_executor(self.compute, self._unload,
                                                             command.name)
            return AdapterReply(engine_id=self.engine_id)
        if command.action != "load":
            return AdapterReply(engine_id=self.engine_id,
                                error=f"unknown adapter action {command.action!r}")
        if adapters.holds(command.name):
            return AdapterReply(engine_id=self.engine_id)
        pending = self._preparing.get(command.name)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch_and_prepare(command.name))
            self._preparing[command.name] = pending
            pending.add_done_callback(lambda _: self._preparing.pop(command.name, None))
        return AdapterReply(engine_id=self.engine_id, error=await asyncio.shield(pending))

    def _unload(self, name: str) -> None:
        """Forget `name` now, or once the requests running on it end (runner.py collects)."""
        assert self.runner.adapters is not None
        self.runner.adapters.forget(name)
        self.runner.adapters.collect({s.params.adapter for s in self.runner.requests.values()})

    async def _fetch_and_prepare(self, name: str) -> str:
        assert self.store is not None
        try:
            blob = await self.store.get(name)
        except AdapterStoreUnavailable as exc:
            return f"adapter {name!r}: {exc}"
        if blob is None:
            return f"no adapter named {name!r} in the adapter store (was it unloaded?)"
        try:
            problem = await self._prepare_blob(name, blob)
        except ValueError as exc:
            problem = str(exc)
        if problem:
            log.warning("adapter refused", adapter=name, reason=problem)
        else:
            log.info("adapter prepared", adapter=name, num_bytes=len(blob))
        return problem

    async def _prepare_blob(self, name: str, blob: bytes) -> str:
        """Parse off the loop, then know it on the forward thread; "" or why it does not fit."""
        assert self.runner.adapters is not None
        # imported here, not above: it imports torch, which the executor imports only after
        # configuring OpenMP, and which `llmbus up` and the other services never need
        from llmbus.services.executor.weights.lora_files import read_adapter

        weights = await asyncio.to_thread(read_adapter, blob, self.architecture,
                                          self.runner.config)
        return await asyncio.get_running_loop().run_in_executor(
            self.compute, self.runner.adapters.prepare, name, weights)

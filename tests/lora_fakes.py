"""What the LoRA api tests (tests/api/test_lora_*.py) share: the real api (its app and
EngineClient, served by uvicorn) on a real nats-server with JetStream and the services' users,
and stand-ins for the stages around it, each connected as its own bus user, so that every
subject they use is one its permissions allow:

- FakePipeline: the tokenizer (admits requests, remembers them) and the scheduler (the model's
  description, engine stats, and two tokens of text for every request);
- FakeEngine: an executor (heartbeats with its engine id; answers AdapterCommand on
  EXECUTOR_ADAPTERS as the real executor will, after reading the adapter from the store);
- stand_in_packer: pack_adapter's contract (a folder in, bytes out, ValueError with one line
  for what is no adapter) until the adapter files' reader lands (issue 44).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from llmbus.bus import subjects
from llmbus.bus.messages import (
    AdapterCommand,
    AdapterReply,
    Admission,
    DeltaBatch,
    EngineStats,
    EngineStatsRequest,
    FinishReason,
    GenerateRequest,
    Heartbeat,
    ModelInfo,
    ModelInfoRequest,
    TextDelta,
)
from llmbus.services.adapter_store_bus import AdapterStore
from llmbus.services.api.app import ApiSettings, create_app
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.api.service import answer_metrics
from llmbus.services.launcher import Stack
from tests.bus_users import ConnectAs
from tests.served_app import served

MODEL = "tiny"
KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def stand_in_packer(path: str) -> bytes:
    """A folder's adapter_config.json and weights file as one blob; ValueError naming what
    does not fit when `r` is no rank (as pack_adapter refuses a file with one line)."""
    folder = Path(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise ValueError(f"{folder.name}/adapter_config.json: `r` must be a rank of 1 or more, "
                         f"not {config.get('r')!r}")
    return json.dumps(config).encode() + b"\n" + (folder / "adapter_model.bin").read_bytes()


def write_adapter(folder: Path, rank: int | str = 8, weights: bytes = b"\x00" * 64) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    (folder / "adapter_model.bin").write_bytes(weights)
    return str(folder)


class FakePipeline:
    """The tokenizer and scheduler users: admits every request and streams 'Hello world'."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self._streams: set[asyncio.Task] = set()

    async def start(self, connect: ConnectAs, stack, url: str, exits: AsyncExitStack) -> None:
        self.tokenizer = await exits.enter_async_context(connect(stack, url, "tokenizer"))
        self.scheduler = await exits.enter_async_context(connect(stack, url, "scheduler"))
        await self.tokenizer.on_request(subjects.TOKENIZER_GENERATE, GenerateRequest,
                                        self._admit, concurrency=8)
        await self.scheduler.on_request(subjects.ENGINE_MODEL, ModelInfoRequest, self._model)
        await self.scheduler.on_request(subjects.ENGINE_STATS, EngineStatsRequest, self._stats)

    async def _admit(self, request: GenerateRequest, _) -> Admission:
        self.requests.append(request)
        task = asyncio.create_task(self._stream(request))  # deltas may precede the admission
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)
        return Admission(num_prompt_tokens=3, scheduler_instance_id="s")

    async def _stream(self, request: GenerateRequest) -> None:
        for step, (text, reason) in enumerate([("Hello", FinishReason.NONE),
                                               (" world", FinishReason.LENGTH)]):
            await self.scheduler.publish(request.reply_subject, DeltaBatch(items=[TextDelta(
                request_id=request.request_id, text=text, num_new_tokens=1,
                finish_reason=reason, num_prompt_tokens=3, num_output_tokens=step + 1,
                token_ids=[100 + step])]))

    async def _model(self, _: ModelInfoRequest, __) -> ModelInfo:
        return ModelInfo(model_name=MODEL, max_model_len=64, engine_id="e0")

    async def _stats(self, _: EngineStatsRequest, __) -> EngineStats:
        return EngineStats(engine_id="e0", num_steps=1, num_running=0, num_waiting=0,
                           num_free_blocks=8, num_total_blocks=8, max_batch_size=2,
                           num_preemptions=0, num_finished=0)


class FakeEngine:
    """An executor user: heartbeats as engine `engine_id` with its resident adapters; loads
    an adapter by reading it from the store, refusing it with `refuse` (one line) where given,
    or as an engine started without adapters where not `enabled`."""

    def __init__(self, engine_id: str, *, enabled: bool = True, refuse: str = "") -> None:
        self.engine_id, self.enabled, self.refuse = engine_id, enabled, refuse
        self.commands: list[tuple[str, str]] = []
        self.resident: dict[str, bytes] = {}

    async def start(self, connect: ConnectAs, stack, url: str, exits: AsyncExitStack) -> None:
        self.runtime = await exits.enter_async_context(connect(stack, url, "executor"))
        self.store = await AdapterStore.open(self.runtime)
        await self.runtime.on_request(subjects.EXECUTOR_ADAPTERS, AdapterCommand, self._command)
        self.runtime.mark_ready(lambda: Heartbeat(
            service="executor", instance_id=self.runtime.instance_id, engine_id=self.engine_id,
            adapters=sorted(self.resident)))

    async def _command(self, command: AdapterCommand, _) -> AdapterReply:
        self.commands.append((command.action, command.name))
        if command.action == "unload":
            self.resident.pop(command.name, None)
            return AdapterReply(engine_id=self.engine_id, enabled=self.enabled)
        if not self.enabled:
            return AdapterReply(engine_id=self.engine_id, enabled=False)
        blob = await self.store.get(command.name)
        if blob is None:
            return AdapterReply(engine_id=self.engine_id, error="not in the adapter store")
        if self.refuse:
            return AdapterReply(engine_id=self.engine_id, error=self.refuse)
        self.resident[command.name] = blob
        return AdapterReply(engine_id=self.engine_id)


@asynccontextmanager
async def api_copy(connect: ConnectAs, stack, url: str, *,
                   load_timeout: float = 5.0) -> AsyncIterator[httpx.AsyncClient]:
    """One api copy (the api user, its own instance id, the bus's adapter store, the stand-in
    packer) served by uvicorn in this event loop; yields an HTTP client of it."""
    async with connect(stack, url, "api") as runtime:
        engine = EngineClient(runtime, request_timeout=10.0)
        await engine.start()
        store = await AdapterStore.open(runtime)
        app = create_app(engine, ApiSettings(api_key=KEY, adapter_load_timeout=load_timeout),
                         adapter_store=store, pack_adapter=stand_in_packer)
        await answer_metrics(runtime, app)
        runtime.mark_ready()  # heartbeats: /metrics gathers every live copy
        async with served(app) as root, httpx.AsyncClient(base_url=root, headers=AUTH,
                                                          timeout=30) as http:
            yield http


async def wait_for_engines(http: httpx.AsyncClient, engine_ids: set[str]) -> None:
    """Until the api copy has heard every engine's heartbeat (the pipeline view lists them)."""
    async with asyncio.timeout(10):
        while True:
            view = (await http.get("/v1/pipeline")).json()
            [executors] = [s for s in view["stages"] if s["name"] == "executor"]
            if engine_ids <= {c["engine_id"] for c in executors["copies"]}:
                return
            await asyncio.sleep(0.05)



class LoraWorld:
    """A real nats-server (fresh: an empty adapter store), the fake pipeline, and the engines
    and api copies a test starts; everything stops with the fixture that made it."""

    def __init__(self, connect: ConnectAs, stack, url: str, exits: AsyncExitStack) -> None:
        self.connect, self.stack, self.url, self.exits = connect, stack, url, exits
        self.pipeline = FakePipeline()

    async def engine(self, engine_id: str, **kwargs: Any) -> FakeEngine:
        engine = FakeEngine(engine_id, **kwargs)
        await engine.start(self.connect, self.stack, self.url, self.exits)
        return engine

    async def api(self, **kwargs: Any) -> httpx.AsyncClient:
        return await self.exits.enter_async_context(
            api_copy(self.connect, self.stack, self.url, **kwargs))


@asynccontextmanager
async def lora_world(connect: ConnectAs) -> AsyncIterator[LoraWorld]:
    stack = Stack()
    url = stack.start_nats()
    try:
        async with AsyncExitStack() as exits:
            world = LoraWorld(connect, stack, url, exits)
            await world.pipeline.start(connect, stack, url, exits)
            yield world
    finally:
        stack.stop()

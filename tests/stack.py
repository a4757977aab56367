"""What tests share about a real stack: auth, the default model's name, skipping without it;
the stack itself comes from the bench package (benchmark scripts start it the same way)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from llmbus.bench.stack import MODEL_NAME, RunningStack, engine_stats, start_stack, stop_stack
from llmbus.services.launcher import Stack, _start_services, free_port, wait_until_ready
from llmbus.services.model_files import default_model_path

__all__ = ["API_KEY", "AUTH", "MODEL_NAME", "REPO", "TWO_OF_EACH_ARGV", "ApiCopies",
           "RunningStack", "engine_holding", "engine_stats", "needs_default_model",
           "processes_mentioning", "sse_events", "start_stack", "stop_stack"]

REPO = Path(__file__).resolve().parent.parent
API_KEY = "llmbus-test-key"  # the shared stack requires it, so every test exercises auth
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The options of conftest's two_of_each stack, by stage (the api's port apart): the tests that
# kill one of its processes start it again with them.
TWO_OF_EACH_ARGV = {"scheduler": ["--max-num-seqs", "32"],
                    "executor": ["--threads", "1", "--exact", "--enable-lora"]}


def needs_default_model() -> pytest.MarkDecorator:
    return pytest.mark.skipif(not default_model_path().is_file(),
                              reason="default model not pulled (`llmbus model pull`)")


async def sse_events(http: httpx.AsyncClient, url: str, body: dict) -> AsyncIterator[dict]:
    """The JSON events of one streamed OpenAI-style answer, once its status is 200."""
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[len("data: "):])


async def engine_holding(nats_url: str, engine_ids: tuple[str, ...] = ("engine0", "engine1"),
                         ) -> str | None:
    """The first of `engine_ids` running requests now (None: none is)."""
    for engine_id in engine_ids:
        if (await engine_stats(nats_url, engine_id)).num_running:
            return engine_id
    return None


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (our children carry the nats URL/port)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


@dataclass
class ApiCopies:
    """A stack whose api copies each listen on a port of their own (with the bus's users and
    permissions), so a test can choose which copy answers and restart one alone."""

    stack: Stack
    nats_url: str
    ports: list[int]
    argv: list[str]  # every api copy's options

    @classmethod
    def start(cls, service_argv: dict[str, list[str]], copies: int = 2,
              timeout: float = 300.0) -> ApiCopies:
        stack = Stack()
        url = stack.start_nats()
        counts = _start_services(stack, url, service_argv, {
            "api": 0, "tokenizer": 1, "detokenizer": 1, "engine": 1})
        api = cls(stack, url, [free_port() for _ in range(copies)], service_argv.get("api", []))
        for index in range(copies):
            api._start_copy(index)
        dead = wait_until_ready(stack, f"{api.base_url(0).removesuffix('/v1')}/health",
                                timeout, counts | {"api": copies})
        if dead is not None:
            stack.stop()
            raise RuntimeError(f"{dead.name} died while starting: {list(dead.tail)}")
        return api

    def base_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.ports[index]}/v1"

    def _start_copy(self, index: int) -> None:
        self.stack.start_service("api", ["--nats-url", self.nats_url, *self.argv, "--port",
                                         str(self.ports[index])], f"api.{index}")

    def restart(self, index: int, timeout: float = 60.0) -> None:
        """Stop api copy `index` (SIGTERM, as a rolling restart does) and start it again."""
        [child] = [c for c in self.stack.children if c.name == f"api.{index}"]
        child.process.terminate()
        child.process.wait(30)
        self.stack.children.remove(child)
        self._start_copy(index)
        dead = wait_until_ready(self.stack, f"{self.base_url(index).removesuffix('/v1')}/health",
                                timeout)
        assert dead is None, f"{dead.name} died: {list(dead.tail)}"

    def stop(self) -> None:
        self.stack.stop()

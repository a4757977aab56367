"""A real llmbus stack for benchmark scripts and tests: `llmbus up` as a user runs it, stopped
again, and its engine's stats read off the bus."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nats

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import EngineStats, EngineStatsRequest
from llmbus.services.launcher import free_port

MODEL_NAME = "smollm2-135m-instruct"  # what the default model is served as


@dataclass
class RunningStack:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT/v1
    nats_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _end_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it dies, so a
    killed test or benchmark run leaves no stack behind (`llmbus up` stops its services)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_stack(tmp_dir: Path, *extra: str, timeout: float = 240.0,
                env: dict[str, str] | None = None) -> RunningStack:
    """Run `llmbus up` as a user would; return once it prints that it is ready."""
    port = free_port()
    log_path = tmp_dir / f"llmbus-up-{port}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(
        [sys.executable, "-m", "llmbus.services.cli", "up", "--port", str(port), *extra],
        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), preexec_fn=_end_with_parent)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        match = re.search(r"llmbus is ready: (\S+) \(nats: ([^;\s)]+)(?:; observer URL in "
                          r"(\S+))?\)", text)
        if match:  # the observer's credentials are in a file the line names, if any
            url = Path(match.group(3)).read_text().strip() if match.group(3) else match.group(2)
            return RunningStack(process, match.group(1), url, log_path)
        if process.poll() is not None:
            raise RuntimeError(f"llmbus up exited with {process.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"llmbus up not ready in {timeout} s:\n{log_path.read_text()[-4000:]}")


def stop_stack(stack: RunningStack, timeout: float = 30.0) -> int:
    if stack.process.poll() is None:
        stack.process.send_signal(signal.SIGTERM)
    return stack.process.wait(timeout)


async def engine_stats(nats_url: str, engine_id: str = "engine0") -> EngineStats:
    nc = await nats.connect(nats_url)
    try:
        msg = await nc.request(subjects.engine_stats(engine_id), encode(EngineStatsRequest()),
                               timeout=5)
        return decode(msg.data, EngineStats)
    finally:
        await nc.close()

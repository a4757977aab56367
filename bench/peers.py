"""Starting, watching and stopping the servers that `bench compare` measures.

Each server runs in its own session (process group) so that stopping it ends its whole tree,
and a sampler thread walks /proc for that tree's memory: llmbus is six processes, and the
number that matters to a user is what all of them hold together.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def peers_dir() -> Path:
    """Where bench/install_peers.sh puts one venv per peer."""
    default = Path.home() / ".cache" / "llmbus" / "peers"
    return Path(os.environ.get("LLMBUS_PEERS_DIR", default))


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and all its descendants (children may start their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # the command name may contain spaces: fields after the last ')' are fixed
                ppid = int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_memory_mib(root_pid: int) -> tuple[float, float]:
    """(RSS, PSS) of a process tree in MiB; PSS does not count shared libraries once per
    process, so it is the fairer total for a multi-process server."""
    rss = pss = 0
    for pid in process_tree(root_pid):
        try:
            with open(f"/proc/{pid}/statm") as statm:
                rss += int(statm.read().split()[1]) * PAGE_SIZE
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            continue
    return rss / 2**20, pss / 2**20


class MemorySampler:
    """Peak RSS/PSS of a process tree, sampled every `interval` seconds in a thread.

    Reading PSS walks every page table: ~10 ms of CPU per sample for llmbus's 7 processes.
    Every 0.5 s that took ~0.25 ms a token from a 2-core server at one stream; every 2 s it
    is a quarter of that, and these servers' memory plateaus for seconds at a time."""

    def __init__(self, root_pid: int, interval: float = 2.0) -> None:
        self.root_pid, self.interval = root_pid, interval
        self.peak_rss_mib = self.peak_pss_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = tree_memory_mib(self.root_pid)
            self.peak_rss_mib = max(self.peak_rss_mib, rss)
            self.peak_pss_mib = max(self.peak_pss_mib, pss)
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class ServerSpec:
    """How to start one OpenAI-compatible server and what to record about it."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    info: dict[str, object] = field(default_factory=dict)  # version, threads, flags
    ready_timeout: float = 600.0
    cwd: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


class RunningServer:
    """A started server: waits for /health, stops its whole process group, keeps a log."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            spec.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}, cwd=spec.cwd,
            start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self) -> float:
        """Seconds until /health answers 200; raises with the log's tail if it dies first."""
        url = f"http://127.0.0.1:{self.spec.port}/health"
        deadline = self.started + self.spec.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.spec.name} not ready in {self.spec.ready_timeout} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after `timeout` seconds."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self._log.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def command_output(argv: list[str], timeout: float = 120.0) -> str:
    """First line of a command's output, or why it failed (for version records)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    # the answer is the last line printed on stdout (after any banner), else stderr's first
    if done.stdout.strip():
        return done.stdout.strip().splitlines()[-1]
    text = done.stderr.strip()
    return text.splitlines()[0] if text else f"unknown (exit {done.returncode})"

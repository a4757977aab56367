# Over 300 lines: one script that runs a load and a fault schedule side by side on the cluster
# of cluster_check.py, then judges every request against its undisturbed answer.
"""Chaos soak: faults that come every few seconds, overlapping, while requests arrive.

    sudo .venv/bin/python -m llmbus.bench.chaos [--seconds 600] [--seed 0] [--json FILE]

The cluster is cluster_check.py's (three network-namespace hosts, a three-server NATS cluster
with TLS and one user per service), every service given the same server list, with two copies
of every stage: api copies on one port of host 1, tokenizers on hosts 1 and 3, engines and
detokenizers on hosts 2 and 3. Engines run in exact mode, so an answer computed again after a
fault equals the undisturbed one.

Requests arrive as a Poisson process, each one of a fixed pool (chat and text completions,
streamed and not, some with tools or a JSON schema; greedy), whose undisturbed answers are
taken first. A tenth of the streams are left by their client after a few chunks. Every 15-40 s
(`--fault-every`) a fault starts, overlapping those still on:
  kill    kill -9 of a stage copy or a nats-server, started again after 3-10 s
  stop    SIGSTOP of one, SIGCONT after 2-8 s
  cut     a host's link down (no RST) for 5-20 s
  netem   200 ms delay or 5% packet loss on a host's link for 5-20 s (where the kernel
          lacks netem: a loss by nftables, and a link throttled to 1 Mbit/s by tc tbf)
The report: requests sent, answered with the undisturbed answer, ended with an error (its text
and the faults it overlapped), hung (none may be), left by their client and how soon their
abort reached the engine, migrations, KV blocks held at the end, copies some stage took for
dead while no fault touched them or their judge, and the longest stall of a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from llmbus.bench.client import _sse_chunks
from llmbus.bench.cluster_check import LAYOUT, TOPICS, Cluster, _named, cannot_run
from llmbus.bench.metrics import percentile
from llmbus.bench.netns_hosts import Hosts
from llmbus.bench.stack import MODEL_NAME
from llmbus.bus.liveness import DEAD_AFTER

# Two copies of every stage: cluster_check's layout, a second api and a second tokenizer.
CHAOS_LAYOUT = [*LAYOUT, (1, "api", "api2", []), (3, "tokenizer", "tok3", ["--routing", "random"])]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# A stream its client leaves: long enough to be running still when the abort comes.
LEFT_STREAM = {"path": "chat/completions", "body": {
    "model": MODEL_NAME, "stream": True, "max_tokens": 400, "ignore_eos": True,
    "temperature": 0, "messages": [{"role": "user", "content": "Tell me a long story."}]}}
COMPOUND_STREAMS, COMPOUND_TOKENS = 8, 120  # per phase of the compound case
HUNG_AFTER = 120.0  # seconds after the load ends: a request still open then is hung
ABORT_WITHIN = 1.0  # a left stream's abort reaches its engine within this, faults aside
SDK_RETRIES, RETRIED_STATUSES = 2, {408, 409, 429, 500, 502, 503, 504}  # openai-python's


@dataclass
class Fault:
    kind: str
    target: str  # a process, or "h<host>"
    started: float  # wall clock
    ended: float = float("inf")
    touches: set[str] = field(default_factory=set)  # the processes it silences

    def covers(self, wall: float, grace: float = 0.0) -> bool:
        return self.started <= wall <= self.ended + grace

    def __str__(self) -> str:
        return f"{self.kind} {self.target}"


@dataclass
class Outcome:
    shape: int  # its request in the pool; -1: a stream its client leaves (LEFT_STREAM)
    sent: float  # wall clock
    ended: float = 0.0
    answer: str = ""
    error: str = ""
    request_id: str = ""
    left_at: float = 0.0  # when its client left it (0: it did not)
    retries: int = 0  # tries after the first (`send`)
    phase: str = ""  # of the compound case, if it is one of its streams
    longest_stall: float = 0.0


def compound_stream(topic: str) -> dict:
    """One of the compound case's streams (issue 46): greedy, long enough to meet its fault."""
    return {"path": "chat/completions", "body": {
        "model": MODEL_NAME, "stream": True, "max_tokens": COMPOUND_TOKENS, "ignore_eos": True,
        "temperature": 0, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}}


def request_pool(rng: random.Random, size: int) -> list[dict]:
    """Request bodies, each a path and its JSON: greedy, of every kind the api serves."""
    pool = []
    for i in range(size):
        topic, stream = TOPICS[i % len(TOPICS)], rng.random() < 0.6
        body: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(12, 40), "temperature": 0,
                      "stream": stream}
        kind = rng.choices(["chat", "text", "tools", "schema"], [6, 2, 1, 1])[0]
        if kind == "text":
            pool.append({"path": "completions", "body": body | {
                "prompt": f"A short note about {topic}:"}})
            continue
        body["messages"] = [{"role": "user", "content": f"Tell me about {topic}."}]
        if kind == "tools":
            body |= {"tools": [WEATHER], "tool_choice": "required", "messages": [
                {"role": "user", "content": f"What is the weather like near {topic}?"}]}
        elif kind == "schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}}
        pool.append({"path": "chat/completions", "body": body})
    return pool


def _answer_of(choice: dict, streamed: bool) -> str:
    """What a choice says, tool calls' names and arguments included (not their random ids)."""
    part = choice.get("delta" if streamed else "message") or {}
    text = part.get("content") or choice.get("text") or ""
    calls = "".join(f"<{c.get('function', {}).get('name') or ''}"
                    f"{c.get('function', {}).get('arguments') or ''}>"
                    for c in part.get("tool_calls") or [])
    return text + calls + (f"|{choice['finish_reason']}" if choice.get("finish_reason") else "")


async def send(http: httpx.AsyncClient, url: str, request: dict, outcome: Outcome,
               leave_after: int = 0) -> None:
    """One request, tried again as the official OpenAI SDK does (up to SDK_RETRIES more
    times, when no response came or its status was 408, 409, 429 or 5xx: a client's part,
    not the server's); its answer or error in `outcome`. With `leave_after`, the client
    closes the stream after that many chunks."""
    try:
        for retry in range(SDK_RETRIES + 1):
            outcome.answer, outcome.error = "", ""
            if not await _try(http, url, request, outcome, leave_after) or retry == SDK_RETRIES:
                return
            outcome.retries += 1
            await asyncio.sleep(0.5 * 2**retry)
    finally:
        outcome.ended = time.time()


async def _try(http: httpx.AsyncClient, url: str, request: dict, outcome: Outcome,
               leave_after: int) -> bool:
    """One try; whether the SDK would try again (no response, or a status it retries)."""
    body = request["body"]
    try:
        if not body["stream"]:
            response = await http.post(f"{url}/{request['path']}", json=body)
            reply = response.json()
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: " + str(
                    reply.get("error", {}).get("message", reply))
                return response.status_code in RETRIED_STATUSES
            outcome.request_id = reply["id"]
            outcome.answer = "".join(_answer_of(c, False) for c in reply["choices"])
            return False
        async with http.stream("POST", f"{url}/{request['path']}", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return response.status_code in RETRIED_STATUSES
            chunks, last = 0, time.monotonic()
            async for chunk in _sse_chunks(response):
                now = time.monotonic()
                outcome.longest_stall, last = max(outcome.longest_stall, now - last), now
                if chunk.get("error"):
                    outcome.error = chunk["error"].get("message", "error")
                    return False
                outcome.request_id = chunk.get("id", outcome.request_id)
                outcome.answer += "".join(_answer_of(c, True) for c in chunk.get("choices", []))
                chunks += 1
                if chunks == leave_after:
                    outcome.left_at = time.time()
                    return False  # the context manager closes the connection: the client left
        return False
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return True
    except httpx.RemoteProtocolError as exc:  # retried by the SDK only before a response
        outcome.error = f"{type(exc).__name__}: {exc}"
        return "without sending a response" in str(exc)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return False


async def take_answers(url: str, pool: list[dict]) -> list[str]:
    """Each request of the pool once, eight at a time, undisturbed: the answers to expect."""
    outcomes = [Outcome(i, time.time()) for i in range(len(pool))]
    limit = asyncio.Semaphore(8)

    async def one(outcome: Outcome) -> None:
        async with limit:
            await send(http, url, pool[outcome.shape], outcome)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(one(o) for o in outcomes))
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise RuntimeError(f"the undisturbed answers failed: {failed[:3]}")
    return [o.answer for o in outcomes]


class Faults:
    """Starts a random fault every `every` seconds (a range), each ended on its own clock."""

    def __init__(self, cluster: Cluster, rng: random.Random, every: tuple[float, float]) -> None:
        self.cluster, self.rng, self.every = cluster, rng, every
        self.log: list[Fault] = []
        self.impairments = cluster.hosts.impairments()  # netem's, or what stands in for it
        self.until = float("inf")  # when the load ends (`run`)
        self._tasks: set[asyncio.Task] = set()

    def _busy(self) -> set[str]:
        return {f.target for f in self.log if f.ended == float("inf")}

    def _hosts_of(self, host: int) -> set[str]:
        return {f"nats{host}"} | {name for h, _, name, _ in self.cluster.layout if h == host}

    async def _last(self, seconds: float) -> None:
        """A fault's duration, cut short where the load ends first (no fault outlives it)."""
        await asyncio.sleep(max(min(seconds, self.until - time.monotonic()), 0.5))

    async def run(self, until: float, opener: asyncio.Task | None = None) -> None:
        """Random faults until `until`, after the `opener` (the compound case) ends."""
        self.until = until
        if opener is not None:
            await opener
        while True:
            await asyncio.sleep(self.rng.uniform(*self.every))
            if time.monotonic() >= until:
                break
            fault = self._pick()
            if fault is not None:
                self.log.append(fault)
                print(f"  {time.strftime('%H:%M:%S')} {fault}", flush=True)
                task = asyncio.create_task(self._play(fault))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        await asyncio.gather(*self._tasks)

    def _pick(self) -> Fault | None:
        kind = self.rng.choice(["kill", "kill", "stop", "cut", "netem"])
        busy, now = self._busy(), time.time()
        if kind in ("kill", "stop"):
            names = sorted(n for n in self.cluster.processes if n not in busy)
            target = self.rng.choice(names)
            return Fault(kind, target, now, touches={target})
        hosts = [h for h in (1, 2, 3) if f"h{h}" not in busy]
        if not hosts or (kind == "netem" and not self.impairments):
            return None
        host = self.rng.choice(hosts)
        touches = self._hosts_of(host) if kind == "cut" else set()
        return Fault(kind, f"h{host}", now, touches=touches)

    async def _play(self, fault: Fault) -> None:
        cluster, rng = self.cluster, self.rng
        if fault.kind == "kill":
            cluster.kill(fault.target)
            await self._last(rng.uniform(3, 10))
            cluster.restart(fault.target)
        elif fault.kind == "stop":
            cluster.processes[fault.target].send_signal(signal.SIGSTOP)
            await self._last(rng.uniform(2, 8))
            cluster.processes[fault.target].send_signal(signal.SIGCONT)
        else:
            host = int(fault.target[1:])
            if fault.kind == "cut":
                cluster.hosts.partition(host, cut=True)
            else:
                fault.kind = rng.choice(self.impairments)
                cluster.hosts.impair(host, fault.kind)
            await self._last(rng.uniform(5, 20))
            if fault.kind == "cut":
                cluster.hosts.partition(host, cut=False)
            else:
                cluster.hosts.impair(host, None)
        fault.ended = time.time()


async def compound_case(cluster: Cluster, http: httpx.AsyncClient, pool: list[dict],
                        faults: Faults, outcomes: list[Outcome]) -> None:
    """Issue 46's compound case, amid the load: 8 streams, and the api's server (host 1's)
    killed once they stream and left down; then 8 new streams, and host 2 cut off once they
    stream, left cut until they end (every stage that had moved to host 2's server must move
    again). Then the cluster is whole again. The streams are the pool's last 8 requests."""
    first, left_on = len(pool) - COMPOUND_STREAMS, []
    for phase, target in (("nats-api-left-down", "nats1"), ("partition-left-cut", "h2")):
        mine = [Outcome(first + i, time.time(), phase=phase) for i in range(COMPOUND_STREAMS)]
        outcomes.extend(mine)
        streams = [asyncio.create_task(send(http, cluster.base_url, pool[o.shape], o))
                   for o in mine]
        await asyncio.sleep(3.0)  # each under way: 10 or more chunks
        fault = Fault("kill (left down)" if target == "nats1" else "cut (left cut)", target,
                      time.time(), touches={"nats1"} if target == "nats1" else
                      faults._hosts_of(2))
        faults.log.append(fault)
        left_on.append(fault)
        print(f"  {time.strftime('%H:%M:%S')} compound: {fault}", flush=True)
        if target == "nats1":
            cluster.kill("nats1")
        else:
            cluster.hosts.partition(2, cut=True)
        await asyncio.gather(*streams)
    cluster.hosts.partition(2, cut=False)
    cluster.restart("nats1")
    for fault in left_on:
        fault.ended = time.time()
    await cluster.wait_ready()


async def soak(cluster: Cluster, pool: list[dict], args: argparse.Namespace,
               faults: Faults) -> list[Outcome]:
    """Poisson arrivals for `args.seconds`, the faults beside them; every request's outcome
    (one still open HUNG_AFTER seconds after the load ends is cancelled: hung)."""
    rng = random.Random(args.seed + 1)
    outcomes: list[Outcome] = []
    tasks: dict[asyncio.Task, Outcome] = {}
    until = time.monotonic() + args.seconds
    timeout = httpx.Timeout(HUNG_AFTER + 60, connect=10)
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        opener = asyncio.create_task(compound_case(cluster, http, pool, faults, outcomes)) \
            if args.compound else None
        fault_task = asyncio.create_task(faults.run(until, opener))
        while time.monotonic() < until:
            shape = rng.randrange(len(pool) - COMPOUND_STREAMS)
            request, leave = pool[shape], 0
            if request["body"]["stream"] and rng.random() < 0.1:  # one its client will leave
                request, leave = LEFT_STREAM, rng.randint(2, 6)
            outcomes.append(Outcome(-1 if leave else shape, time.time()))
            tasks[asyncio.create_task(send(http, cluster.base_url, request, outcomes[-1],
                                           leave))] = outcomes[-1]
            await asyncio.sleep(rng.expovariate(args.rate))
        await fault_task
        done, pending = await asyncio.wait(tasks, timeout=HUNG_AFTER)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in pending:  # hung: cancelled, not ended
            tasks[task].ended = 0.0
    return outcomes


def judge(cluster: Cluster, outcomes: list[Outcome], answers: list[str], faults: list[Fault],
          since: float, held: dict[str, int]) -> dict:
    """The soak's report (see the module's docstring)."""
    lines = cluster.log_lines_since(since)
    left = [o for o in outcomes if o.left_at]
    judged = [o for o in outcomes if o.shape >= 0]
    hung = [o for o in judged if not o.ended]
    errors = [o for o in outcomes if o.ended and o.error]
    for o in errors:  # the faults each error overlapped
        o.error += f" [{_overlapping(faults, o.sent, o.ended)}]"
    wrong = [o for o in judged if o.ended and not o.error and o.answer != answers[o.shape]]
    abort_delays = {}
    for o in left:
        aborted = [wall for wall, name, line in lines if name in ("e1", "e2")
                   and "aborted" in line and o.request_id in line and wall >= o.left_at - 0.5]
        abort_delays[o.request_id] = round(min(aborted, default=float("inf")) - o.left_at, 2)
    late = {o.request_id: f"{d} s [{_overlapping(faults, o.left_at, o.left_at + min(d, 30.0))}]"
            for o in left if (d := abort_delays[o.request_id]) > ABORT_WITHIN}
    stalls = [o.longest_stall for o in outcomes if o.longest_stall]
    compound = {phase: [o for o in judged if o.phase == phase]
                for phase in dict.fromkeys(o.phase for o in judged if o.phase)}
    return {
        "compound": {phase: {"streams": len(mine), "equal_to_undisturbed": sum(
            not o.error and o.answer == answers[o.shape] for o in mine),
            "errors": [o.error for o in mine if o.error]} for phase, mine in compound.items()},
        "requests": len(outcomes), "judged": len(judged),
        "equal_to_undisturbed": len(judged) - len(hung) - len(errors) - len(wrong),
        "errors": [o.error for o in errors if o.shape >= 0], "unexplained_errors": [
            o.error for o in errors if o.shape >= 0 and o.error.endswith("[]")],
        "different_answers": len(wrong), "hung": len(hung),
        "hung_requests": [f"{o.request_id or '(no id yet)'} (request {o.shape}, sent "
                          f"{time.strftime('%X', time.localtime(o.sent))}) "
                          f"[{_overlapping(faults, o.sent, o.sent + HUNG_AFTER)}]"
                          for o in hung],
        "left_by_client": len(left),
        "to_leave_but_failed_first": [o.error for o in outcomes if o.shape < 0 and not o.left_at],
        "aborts_within_1s": sum(d <= ABORT_WITHIN for d in abort_delays.values()),
        "aborts_later": late,  # inf s: never seen; each with the faults it overlapped
        "unexplained_late_aborts": [i for i, text in late.items() if text.endswith("[]")],
        "unexplained_lost_aborts": [i for i, text in late.items()
                                    if text.startswith("inf") and text.endswith("[]")],
        "retried_by_the_client": sum(o.retries for o in outcomes),
        "migrated": sum("request migrated" in line for _, name, line in lines
                        if name.startswith("api")),
        "kv_blocks_held_after": held, "healthy_copies_reaped": false_reaps(lines, faults),
        # Each stream's longest wait between two chunks: the longest, and their median.
        "longest_stall_s": round(max(stalls, default=0.0), 2),
        "median_longest_stall_s": round(percentile(stalls, 50), 2) if stalls else 0.0,
        "faults": [f"{time.strftime('%X', time.localtime(f.started))} {f} "
                   f"({f.ended - f.started:.0f} s)" for f in faults],
    }


def _overlapping(faults: list[Fault], start: float, end: float) -> str:
    """The faults on at some moment of [start, end] (wall clock), named."""
    return ", ".join(str(f) for f in faults if f.started <= end and start <= f.ended)


def false_reaps(lines: list[tuple[float, str, str]], faults: list[Fault]) -> list[str]:
    """Copies some stage took for dead ("... gone" in its log) while no fault touched them or
    their judge (a fault's silence may be judged up to DEAD_AFTER after it ends)."""
    grace = DEAD_AFTER + 6
    return sorted({f"{judge_} took {_named(line)} for dead at "
                   f"{time.strftime('%X', time.localtime(wall))}"
                   for wall, judge_, line in lines if " gone" in line
                   if not any(f.covers(wall, grace) and {_named(line), judge_} & f.touches
                              for f in faults)})


def passed(report: dict) -> bool:
    """Issue 46's bar: the compound case's streams all answered as undisturbed; no hang,
    nothing held, no healthy copy reaped, every error explained, and at least 99% of the
    judged requests answered as undisturbed."""
    return (all(p["equal_to_undisturbed"] == p["streams"] for p in report["compound"].values())
            and not report["hung"] and not any(report["kv_blocks_held_after"].values())
            and not report["healthy_copies_reaped"] and not report["unexplained_errors"]
            and not report["unexplained_late_aborts"]
            and not report["different_answers"]
            and report["equal_to_undisturbed"] >= 0.99 * report["judged"])


async def main_async(args: argparse.Namespace) -> int:
    if why := cannot_run("chaos"):
        print(why, file=sys.stderr)
        return 2
    hosts = Hosts()
    work = Path(tempfile.mkdtemp(prefix="llmbus-chaos-"))
    cluster = Cluster(hosts, work, same_server_list=True, layout=CHAOS_LAYOUT)
    report: dict = {}
    try:
        hosts.create()
        cluster.start()
        print(f"cluster ready after {await cluster.wait_ready():.1f} s (logs in {work})",
              flush=True)
        pool = request_pool(random.Random(args.seed), args.pool) + [
            compound_stream(topic) for topic in TOPICS[:COMPOUND_STREAMS]]
        answers = await take_answers(cluster.base_url, pool)
        print(f"{len(pool)} undisturbed answers taken; soaking for {args.seconds:.0f} s",
              flush=True)
        since, faults = time.time(), Faults(cluster, random.Random(args.seed + 2),
                                            tuple(args.fault_every))
        outcomes = await soak(cluster, pool, args, faults)
        await cluster.wait_ready()
        await asyncio.sleep(3)  # the last aborts land
        report = judge(cluster, outcomes, answers, faults.log, since,
                       await cluster.held_blocks())
    finally:
        cluster.stop()
        hosts.remove()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if passed(report) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600, help="how long the load runs")
    parser.add_argument("--rate", type=float, default=1.0, help="requests a second (Poisson)")
    parser.add_argument("--seed", type=int, default=0, help="of the requests and the faults")
    parser.add_argument("--pool", type=int, default=32, help="distinct requests")
    parser.add_argument("--fault-every", type=float, nargs=2, default=[15, 40],
                        metavar=("MIN", "MAX"), help="seconds between two faults' starts")
    parser.add_argument("--compound", action="store_true",
                        help="open the soak with issue 46's compound case: 8 streams and the "
                             "api's server killed and left down, then 8 new streams and host 2 "
                             "cut off until they end")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()

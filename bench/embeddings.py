"""Embeddings on the default model, in one run: throughput against llama-server, and what an
embedding client does to streaming chats.

1. Throughput: 256 inputs of exactly 128 tokens, sent as `/v1/embeddings` requests of 32
   inputs, 4 in flight, to `llmbus up` (default fast mode) and to llama-server
   (`--embeddings --pooling mean`), one server at a time, the same threads each. Prints input
   tokens/s (the servers' own `usage.prompt_tokens`) and the ratio (target: llmbus >= 1x), and
   the mean cosine of the two servers' vectors of the same input, as a sanity line.
2. Mixed load (llmbus only): 16 streaming chats (128 tokens out, ignore_eos) alone, then the
   same chats while a client sends batches of 32 inputs without pause. Prints the chats' ITL
   p50/p99 in both runs and the ratio of the p99s (target: <= 1.5x).

A peer that is not installed is skipped with a line saying so (bench/install_peers.sh).

    python -m llmbus.bench.embeddings [--threads 2] [--inputs 256] [--skip-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from llmbus.bench.datasets import random_dataset
from llmbus.bench.metrics import summarize
from llmbus.bench.peers import RunningServer, ServerSpec, peers_dir
from llmbus.bench.serve import RunConfig, run_benchmark
from llmbus.bench.stack import MODEL_NAME, engine_stats, start_stack, stop_stack
from llmbus.services.cpu_features import cpu_label
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.launcher import free_port
from llmbus.services.model_files import default_model_path

TIMEOUT = httpx.Timeout(600.0, connect=30.0)


def log(line: str) -> None:
    print(line, flush=True)


async def embed_all(base_url: str, model: str, texts: list[str], batch: int,
                    concurrency: int) -> tuple[float, int, np.ndarray]:
    """Every text embedded, `batch` inputs a request, `concurrency` requests in flight;
    (seconds, prompt tokens the server counted, unit vectors [N, D] in input order)."""
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    semaphore, done = asyncio.Semaphore(concurrency), [0]
    limits = httpx.Limits(max_connections=concurrency + 1)

    async def one(client: httpx.AsyncClient, inputs: list[str]) -> tuple[int, list]:
        async with semaphore:
            response = await client.post(f"{base_url}/embeddings",
                                         json={"model": model, "input": inputs})
        if response.status_code != 200:
            raise RuntimeError(f"/embeddings answered {response.status_code}: "
                               f"{response.text[:500]}")
        body = response.json()
        done[0] += 1
        if len(batches) > 1 and done[0] % max(1, len(batches) // 4) == 0:
            log(f"  {done[0]}/{len(batches)} requests")
        rows = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
        return body["usage"]["prompt_tokens"], rows

    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(one(client, b) for b in batches))
        seconds = time.perf_counter() - start
    vectors = np.array([row for _, rows in answers for row in rows], dtype=np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return seconds, sum(tokens for tokens, _ in answers), vectors


def measure_throughput(name: str, base_url: str, model: str, texts: list[str],
                       args: argparse.Namespace,
                       nats_url: str | None = None) -> tuple[float, np.ndarray]:
    """Input tokens/s and the vectors; with `nats_url` (llmbus), also where the time went:
    the engine's steps and its executor's busy time over the run."""
    asyncio.run(embed_all(base_url, model, texts[:args.batch], args.batch, 1))  # warm-up
    log(f"{name}: {len(texts)} inputs, {args.batch} a request, {args.concurrency} in flight")
    before = asyncio.run(engine_stats(nats_url)) if nats_url else None
    seconds, tokens, vectors = asyncio.run(embed_all(base_url, model, texts, args.batch,
                                                     args.concurrency))
    rate = tokens / seconds
    log(f"{name}: {tokens} input tokens in {seconds:.2f} s: {rate:,.0f} tokens/s "
        f"({len(texts) / seconds:.1f} inputs/s)")
    if before is not None:
        after = asyncio.run(engine_stats(nats_url))
        steps = after.num_steps - before.num_steps
        busy = after.executor_busy_seconds - before.executor_busy_seconds
        log(f"{name}: {steps} steps, {tokens / max(steps, 1):.0f} tokens a step, executor "
            f"busy {busy:.2f} s of {seconds:.2f} ({busy / seconds:.0%}): "
            f"{tokens / max(busy, 1e-9):,.0f} tokens per busy second")
    return rate, vectors


class EmbeddingPressure:
    """A client in its own thread sending batches of embedding inputs back to back until
    stopped (a thread, so that its HTTP work does not delay the chats' clock readings on the
    event loop; base64, so that it decodes little)."""

    def __init__(self, base_url: str, model: str, texts: list[str]) -> None:
        self.body = {"model": model, "input": texts, "encoding_format": "base64"}
        self.url, self.num_batches, self.failures = f"{base_url}/embeddings", 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=TIMEOUT) as client:
            while not self._stop.is_set():
                response = client.post(self.url, json=self.body)
                if response.status_code == 200:
                    self.num_batches += 1
                else:
                    self.failures.append(f"{response.status_code}: {response.text[:200]}")

    def __enter__(self) -> EmbeddingPressure:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def chat_latencies(base_url: str, tokenizer: GGUFTokenizer, args: argparse.Namespace,
                   seed: int) -> dict[str, float]:
    """The chats' ITL and TTFT p50/p99 in ms, output tok/s (prompts of their own per run: no
    prefix cache hits)."""
    requests = random_dataset(tokenizer, num_requests=args.chats, input_len=args.chat_input_len,
                              seed=1000 + seed)
    config = RunConfig(base_url=base_url, model=MODEL_NAME, endpoint="chat",
                       max_concurrency=args.chats, max_tokens=args.chat_max_tokens,
                       ignore_eos=True, progress=False)
    results, duration, _ = asyncio.run(run_benchmark(requests, config))
    report = summarize(results, duration)
    if report["failed"]:
        raise SystemExit(f"chats: {report['failed']} failed: {report['errors']}")
    return {"p50": report["itl_ms"]["p50"], "p99": report["itl_ms"]["p99"],
            "ttft_p50": report["ttft_ms"]["p50"], "ttft_p99": report["ttft_ms"]["p99"],
            "tok_s": report["output_throughput"]}


def describe(chats: dict[str, float]) -> str:
    return (f"ITL p50 {chats['p50']:7.1f} ms  p99 {chats['p99']:7.1f} ms  TTFT p50 "
            f"{chats['ttft_p50']:7.0f} ms  p99 {chats['ttft_p99']:7.0f} ms  "
            f"{chats['tok_s']:5.0f} output tok/s")


def measure_mixed(base_url: str, tokenizer: GGUFTokenizer, texts: list[str],
                  args: argparse.Namespace) -> tuple[dict, dict, int]:
    log(f"mixed load: {args.chats} streaming chats ({args.chat_max_tokens} out) alone")
    alone = chat_latencies(base_url, tokenizer, args, seed=0)
    log(f"  alone: {describe(alone)}")
    log(f"mixed load: the same chats beside batches of {args.batch} embedding inputs")
    with EmbeddingPressure(base_url, MODEL_NAME, texts[:args.batch]) as pressure:
        mixed = chat_latencies(base_url, tokenizer, args, seed=1)
    if pressure.failures:
        raise SystemExit(f"embedding batches failed: {pressure.failures[:3]}")
    log(f"  mixed: {describe(mixed)}; {pressure.num_batches} embedding batches")
    return alone, mixed, pressure.num_batches


def llama_server(gguf: Path, args: argparse.Namespace) -> ServerSpec | str:
    """llama-server as the issue runs it, or why it is skipped."""
    binary = peers_dir() / "llama-cpp" / "bin" / "llama-server"
    if not binary.exists():
        return f"llama-server not found at {binary}; install: bench/install_peers.sh llama-cpp"
    port = free_port()
    # --no-repack: the AMX repacked path dies with SIGILL on some CPUs (bench/compare.py).
    flags = ["--embeddings", "--pooling", "mean", "-t", str(args.threads), "-c", "8192",
             "-np", "4", "-ub", "2048", "-b", "2048", "--no-repack"]
    return ServerSpec("llama-server", [str(binary), "-m", str(gguf), "--host", "127.0.0.1",
                                       "--port", str(port), *flags], port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="compute threads per server")
    parser.add_argument("--inputs", type=int, default=256, help="inputs embedded per server")
    parser.add_argument("--input-len", type=int, default=128, help="tokens per input")
    parser.add_argument("--batch", type=int, default=32, help="inputs per request")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--chats", type=int, default=16, help="streaming chats (mixed load)")
    parser.add_argument("--chat-input-len", type=int, default=128, help="chat prompt tokens")
    parser.add_argument("--chat-max-tokens", type=int, default=128, help="tokens per chat")
    parser.add_argument("--llmbus-args", default="", help="more `llmbus up` options")
    parser.add_argument("--skip-peer", action="store_true", help="no llama-server")
    parser.add_argument("--skip-mixed", action="store_true", help="no mixed-load part")
    args = parser.parse_args()

    gguf = default_model_path()
    if not gguf.is_file():
        raise SystemExit(f"no default model at {gguf}: run `llmbus model pull`")
    tokenizer = GGUFTokenizer.from_gguf(gguf)
    texts = [r.prompt for r in random_dataset(tokenizer, num_requests=args.inputs,
                                              input_len=args.input_len)]
    log(f"CPU: {cpu_label()}")
    log(f"model: {gguf.name}; {args.threads} threads per server")

    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp), "--threads", str(args.threads), *args.llmbus_args.split())
        try:
            ours, our_vectors = measure_throughput("llmbus", stack.base_url, MODEL_NAME, texts,
                                                   args, stack.nats_url)
            mixed = None if args.skip_mixed else measure_mixed(stack.base_url, tokenizer,
                                                               texts, args)
        finally:
            stop_stack(stack)
        spec = "skipped (--skip-peer)" if args.skip_peer else llama_server(gguf, args)
        theirs = their_vectors = None
        if isinstance(spec, ServerSpec):
            with RunningServer(spec, Path(tmp) / "llama-server.log") as server:
                server.wait_ready()
                theirs, their_vectors = measure_throughput("llama-server", spec.base_url,
                                                           "default", texts, args)

    log("")
    log(f"CPU: {cpu_label().split(':')[0]}; {args.threads} threads; {args.inputs} inputs of "
        f"{args.input_len} tokens, {args.batch} a request, {args.concurrency} in flight")
    log(f"llmbus        {ours:10,.0f} input tokens/s")
    if theirs is None:
        log(f"llama-server  {spec}")
    else:
        cosines = (our_vectors * their_vectors).sum(axis=1)
        log(f"llama-server  {theirs:10,.0f} input tokens/s")
        log(f"ratio llmbus / llama-server: {ours / theirs:.2f}x (target >= 1)")
        log(f"sanity: cosine of the servers' vectors of the same input: mean {cosines.mean():.5f}"
            f", min {cosines.min():.5f}")
    if mixed is not None:
        alone, with_embeddings, num_batches = mixed
        log(f"chats alone        {describe(alone)}")
        log(f"chats + embeddings {describe(with_embeddings)}  ({num_batches} batches of "
            f"{args.batch} beside)")
        log(f"ITL p99 ratio: {with_embeddings['p99'] / alone['p99']:.2f}x (target <= 1.5)")


if __name__ == "__main__":
    main()

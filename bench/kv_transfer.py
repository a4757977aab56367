"""How fast KV blocks move between two executors over the bus, against a prefill's time.

Two processes on one nats-server (the embedded one): a sender with the default
model's KV layout gathers a prompt's blocks and sends them with the executor's KvSender; the
receiver writes them with the executor's KvReceiver. Prints MB/s and seconds per prompt length,
with nothing else running (the bus's own cost), beside the time the default model takes to
prefill that prompt here (one thread, as an engine pinned to a core runs, chunks of 256
tokens, the fast mode's float16 KV); the stack's EngineStats give the transfer under load
(`kv_transfer_seconds`, `kv_wait_seconds`). Usage:

    python -m llmbus.bench.kv_transfer [--tokens 500,2000,8000] [--dtype float16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import time

import torch

from llmbus.bus import subjects
from llmbus.bus.messages import KvChunk, KvDestination, KvReceive, KvReply
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.kv_gathering import gather
from llmbus.services.executor.kv_transfer import KvReceiver, KvSender
from llmbus.services.executor.weights.model_config import LlamaConfig
from llmbus.services.launcher import Stack

ENGINE = "bench-receiver"


def default_model_config() -> LlamaConfig:
    """SmolLM2-135M's KV shape (30 layers, 3 KV heads of 64); the rest does not matter here."""
    return LlamaConfig(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                       num_kv_heads=3, head_dim=64, vocab_size=49152, rope_theta=1e5,
                       rms_norm_eps=1e-5, context_length=8192, bos_token_id=None,
                       eos_token_ids=(2,), tie_word_embeddings=True)


def _cache(num_tokens: int, dtype: torch.dtype, block_size: int = 16) -> KVCache:
    num_blocks = -(-num_tokens // block_size) + 2
    cache = KVCache(default_model_config(), num_blocks, block_size, dtype)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def _receive(url: str, env: dict[str, str], num_tokens: int, dtype: str,
             ready: multiprocessing.Event) -> None:
    os.environ.update(env)

    async def serve() -> None:
        cache = _cache(num_tokens, getattr(torch, dtype))
        receiver = KvReceiver(cache)

        async def on_open(request: KvReceive, _) -> KvReply:
            return receiver.receive(request)

        async def on_chunk(chunk: KvChunk, _) -> KvReply:
            return receiver.write(chunk)

        async with ServiceRuntime("executor", url, handle_signals=False) as runtime:
            await runtime.on_request(subjects.executor_kv_receive(ENGINE), KvReceive, on_open)
            await runtime.on_request(subjects.executor_kv(ENGINE), KvChunk, on_chunk)
            ready.set()
            await asyncio.sleep(3600)

    asyncio.run(serve())


async def _send(url: str, num_tokens: int, dtype: str, repeat: int) -> list[float]:
    cache = _cache(num_tokens, getattr(torch, dtype))
    num_blocks = -(-num_tokens // cache.block_size)
    source = list(range(1, num_blocks + 1))
    times = []
    async with ServiceRuntime("executor", url, handle_signals=False) as runtime:
        assert runtime.nc is not None
        layout_request = KvReceiver(cache)
        for attempt in range(repeat):
            transfer_id = f"bench-{num_tokens}-{attempt}"
            destination = KvDestination(transfer_id=transfer_id, engine_id=ENGINE,
                                        first_block=0, block_ids=source)
            reply = await runtime.request(
                subjects.executor_kv_receive(ENGINE),
                KvReceive(transfer_id=transfer_id, block_ids=source,
                          layout=layout_request.layout), KvReply, timeout=5)
            assert not reply.error, reply.error

            async def send(subject: str, chunk: KvChunk) -> KvReply:
                return await runtime.request(subject, chunk, KvReply, timeout=10)

            sender = KvSender(send, subjects.executor_kv)
            started = time.perf_counter()
            outgoing = gather(cache, destination, source, 0, runtime.nc.max_payload, True)
            [report] = await sender.send_all([outgoing])
            times.append(time.perf_counter() - started)
            assert not report.error, report.error
    return times


def prefill_seconds(num_tokens: int, chunk: int = 256) -> float:
    """The default model's prefill of `num_tokens` random tokens, as a prefill engine runs it
    (the executor's runner, one thread, the scheduler's chunks)."""
    from llmbus.bus.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
    from llmbus.services.executor.backend_choice import choose_backend
    from llmbus.services.executor.runner import ModelRunner
    from llmbus.services.model_files import default_model_path

    block_size = 16
    num_blocks = -(-num_tokens // block_size) + 2
    path = default_model_path()  # the served default: the fast mode's backend
    runner = ModelRunner(path, model_name="bench", choice=choose_backend(path), num_threads=1,
                         small_step_threads=1, num_blocks=num_blocks)
    prompt = [(i * 7919) % 40000 + 100 for i in range(num_tokens)]
    started = time.perf_counter()
    new = [NewRequestData("p", prompt, SamplingParams(max_tokens=1))]
    for step, start in enumerate(range(0, num_tokens, chunk)):
        end = min(start + chunk, num_tokens)
        blocks = list(range(start // block_size + 1, -(-end // block_size) + 1))
        result = runner.step(StepPlan(step_id=step, new_requests=new, scheduled=[
            ScheduledRequest("p", start, end - start, blocks, sample=end == num_tokens)]))
        assert not result.error, result.error
        new = []
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="500,2000,8000")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stack = Stack()
    try:
        url = stack.start_nats(auth=False)  # the same max_payload as with users (1 MB)
        env = dict(stack.env)
        print(f"| prompt tokens | KV {args.dtype} MB | over the bus, s (best of {args.repeat}) "
              "| MB/s | its prefill here, s | transfer / prefill |")
        print("|---:|---:|---:|---:|---:|---:|")
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            ready = multiprocessing.Event()
            receiver = multiprocessing.Process(
                target=_receive, args=(url, env, num_tokens, args.dtype, ready), daemon=True)
            receiver.start()
            ready.wait(60)
            times = asyncio.run(_send(url, num_tokens, args.dtype, args.repeat))
            receiver.terminate()
            receiver.join()
            element = 2 if args.dtype == "float16" else 4
            megabytes = num_tokens * 2 * 30 * 3 * 64 * element / 1e6
            best = min(times)
            prefill = prefill_seconds(num_tokens) if args.dtype == "float16" else math.nan
            print(f"| {num_tokens} | {megabytes:.1f} | {best:.3f} | {megabytes / best:.0f} | "
                  f"{prefill:.2f} | {best / prefill:.1%} |", flush=True)
    finally:
        stack.stop()


if __name__ == "__main__":
    main()

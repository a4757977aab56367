"""A split executor on a real nats-server: the lead shard's and a layer shard's real handlers
(services/executor/pipeline_lead_bus.py, layer_shard_bus.py) on a tiny generated GGUF.

The server's max_payload is cut to 8 KB, so that a step's hidden states (256 bytes a token
here) go out and come back in several parts, as a long prompt's do on the default 1 MB."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import (
    ExecutorInfo,
    ExecutorInfoRequest,
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    ShardInfo,
    ShardInfoRequest,
    StepPlan,
    StepResult,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.cli import build_parser
from llmbus.services.launcher import free_port, nats_server_binary, wait_for_port
from tests.gguf_fixtures import TinySpec, write_tiny_llama

pytestmark = pytest.mark.adapter

SPEC = TinySpec(num_layers=4)
GREEDY = SamplingParams(temperature=0.0, logprobs=2)
PROMPTS = {"a": [1 + (7 * i) % 250 for i in range(70)], "b": [1, 7, 3, 9]}


@pytest.fixture
def small_bus(tmp_path):
    """A nats-server whose max_payload is 8 KB; its URL."""
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f"host: 127.0.0.1\nport: {port}\nmax_payload: 8192\n")
    server = subprocess.Popen([nats_server_binary(), "-c", str(config)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port("127.0.0.1", port, timeout=10)
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def _args(model, engine_id: str, *more: str):
    return build_parser().parse_args(["serve", "executor", "--model", str(model),
                                      "--engine-id", engine_id, "--num-blocks", "40",
                                      "--block-size", "4", "--threads", "1",
                                      "--shutdown-timeout", "0", *more])


async def _serve(url: str, args, stopping: list):
    """The executor `args` describe (whole, lead or layer shard), in this process: its
    coroutine."""
    from llmbus.services.executor import service as executor_service
    from llmbus.services.executor.weights.layer_slice import parse_shard

    runtime = ServiceRuntime("executor", url, handle_signals=False)
    await runtime.__aenter__()
    stopping.append(runtime)
    choice = executor_service.backend_choice_for(args, cuda_available=False)
    index, count, layers = parse_shard(args.shard, args.layers, args.model)
    if index:
        from llmbus.services.executor.layer_shard_bus import serve_layer_shard

        return serve_layer_shard(args, runtime, choice, args.model, layers, index, count, 1,
                                 1 << 30)
    return executor_service.serve(args, runtime, choice, count, layers)


async def _ask(client, subject: str, message, reply_type, wait: float = 120):
    async with asyncio.timeout(wait):  # the first call waits for the model to load
        while True:
            try:
                reply = await client.request(subject, encode(message), timeout=10)
                return decode(reply.data, reply_type)
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.1)


async def _run_plans(client, engine_id: str) -> list[StepResult]:
    """A 70-token prefill beside a 4-token one, then three decodes of both."""
    plans = [StepPlan(step_id=0, new_requests=[NewRequestData(r, p, GREEDY)
                                               for r, p in PROMPTS.items()],
                      scheduled=[ScheduledRequest("a", 0, 70, list(range(1, 19))),
                                 ScheduledRequest("b", 0, 4, [19])])]
    plans += [StepPlan(step_id=i, scheduled=[
        ScheduledRequest("a", 69 + i, 1, [20 + i] if i == 3 else []),
        ScheduledRequest("b", 3 + i, 1, [24] if i == 1 else [])]) for i in (1, 2, 3)]
    return [await _ask(client, subjects.executor_step(engine_id), plan, StepResult)
            for plan in plans]


OVERLAPPING = [  # a's second chunk behind its first (independent), then b's decode (not)
    StepPlan(step_id=0, new_requests=[NewRequestData(r, p, GREEDY) for r, p in PROMPTS.items()],
             scheduled=[ScheduledRequest("a", 0, 40, list(range(1, 11)), sample=False),
                        ScheduledRequest("b", 0, 4, [19])]),
    StepPlan(step_id=1, scheduled=[ScheduledRequest("a", 40, 30, list(range(11, 19)))]),
    StepPlan(step_id=2, scheduled=[ScheduledRequest("b", 4, 1, [20])]),
]


async def _run_overlapping(client, engine_id: str) -> list[StepResult]:
    """OVERLAPPING as the engine loop sends plans: each before the one before has answered
    (a split lead computes plan 1 while plan 0 is in its layer shard)."""
    asked = []
    for plan in OVERLAPPING:
        asked.append(asyncio.create_task(client.request(
            subjects.executor_step(engine_id), encode(plan), timeout=60)))
        await asyncio.sleep(0)  # its request out before the next one's
    return [decode((await reply).data, StepResult) for reply in asked]


async def test_a_split_executor_samples_what_a_whole_one_does(small_bus, tmp_path):
    """Plans one at a time, then plans in flight together, as the engine loop sends them: the
    split lead takes them in its turns (plan_overlap.py), with the whole model's bits."""
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model, SPEC, quantized="Q8_0")
    client = await nats.connect(small_bus)
    runtimes: list[ServiceRuntime] = []
    tasks = [asyncio.create_task(await _serve(small_bus, args, runtimes)) for args in (
        _args(model, "whole"), _args(model, "split", "--shard", "1/2"),
        _args(model, "split", "--shard", "0/2"))]
    try:
        info = await _ask(client, subjects.executor_info("split"), ExecutorInfoRequest(),
                          ExecutorInfo)
        assert (info.num_shards, info.layout, info.num_blocks) == (2, None, 40)
        whole = await _run_plans(client, "whole") + await _run_overlapping(client, "whole")
        split = await _run_plans(client, "split") + await _run_overlapping(client, "split")
        assert all(r.error == "" for r in whole + split), [r.error for r in whole + split]
        assert [(r.sampled_token_ids, r.logprobs) for r in split] == [
            (r.sampled_token_ids, r.logprobs) for r in whole]
    finally:
        for runtime in runtimes:
            runtime.stop_event.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for runtime in runtimes:
            await runtime.close()
        await client.close()


@pytest.mark.parametrize(("shard_file", "shard_layers", "problem"), [
    ("other", None, "shard 1/2 serves other"),
    ("same", "1:4", "holds layers 1:4, but the shards before it end at layer 2: they overlap"),
    ("same", "3:4", "they leave out layers")])
async def test_shards_that_do_not_make_up_one_model_are_refused_in_one_line(
        small_bus, tmp_path, shard_file, shard_layers, problem):
    write_tiny_llama(tmp_path / "same.gguf", SPEC, quantized="Q8_0")
    write_tiny_llama(tmp_path / "other.gguf", SPEC, quantized="Q4_0")
    runtimes: list[ServiceRuntime] = []
    layers = ["--layers", shard_layers] if shard_layers else []
    shard = asyncio.create_task(await _serve(
        small_bus, _args(tmp_path / f"{shard_file}.gguf", "e", "--shard", "1/2", *layers),
        runtimes))
    lead = await _serve(small_bus, _args(tmp_path / "same.gguf", "e", "--shard", "0/2"),
                        runtimes)
    try:
        with pytest.raises(SystemExit) as refused:  # not in a task: asyncio re-raises it
            async with asyncio.timeout(120):
                await lead
        assert str(refused.value).startswith("llmbus executor: engine e's shards do not make "
                                             "up one model: ")
        assert problem in str(refused.value)
    finally:
        for runtime in runtimes:
            runtime.stop_event.set()
        await asyncio.gather(shard, return_exceptions=True)
        for runtime in runtimes:
            await runtime.close()


async def test_a_lead_whose_shard_started_again_exits_in_one_line(small_bus, tmp_path):
    """The lead runs as its own process. A shard that started again has lost its layers' KV,
    which the lead's requests hold: the lead gives its engine up (exit 1, one line), as it
    does for a shard gone (the e2e test kills one), and the engine is then dead by the
    scheduler's heartbeat rules, its requests moving on."""
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model, SPEC, quantized="Q8_0")
    runtimes: list[ServiceRuntime] = []
    shard_args = _args(model, "e", "--shard", "1/2")
    shard = asyncio.create_task(await _serve(small_bus, shard_args, runtimes))
    lead = subprocess.Popen(
        [sys.executable, "-m", "llmbus.services.cli", "serve", "executor", "--model",
         str(model), "--engine-id", "e", "--shard", "0/2", "--nats-url", small_bus,
         "--num-blocks", "40", "--block-size", "4", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = await nats.connect(small_bus)
    try:
        first = (await _run_plans(client, "e"))[0]
        assert first.error == "" and len(first.sampled_token_ids) == 2
        runtimes[0].stop_event.set()  # the shard goes, and a new one comes
        await asyncio.wait_for(shard, 30)
        await runtimes[0].close()
        shard = asyncio.create_task(await _serve(small_bus, shard_args, runtimes))
        await _ask(client, subjects.executor_shard("e", 1, "info"), ShardInfoRequest(),
                   ShardInfo)  # the new shard is up
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await client.request(subjects.executor_step("e"), encode(StepPlan(
                step_id=9, scheduled=[ScheduledRequest("a", 73, 1)])), timeout=3)
        deadline = time.monotonic() + 30
        while lead.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        output = lead.communicate(timeout=10)[0]
        assert lead.returncode == 1, output
        assert "shard 1/2 of engine e started again: the KV cache of its layers is gone; " \
               "exiting, so that engine e's requests move on" in output
    finally:
        lead.kill()
        for runtime in runtimes[1:]:
            runtime.stop_event.set()
        await asyncio.gather(shard, return_exceptions=True)
        for runtime in runtimes[1:]:
            await runtime.close()
        await client.close()

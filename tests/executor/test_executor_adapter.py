"""The executor's bus adapter without the default model: its real handlers on a real
nats-server, a tiny generated GGUF, and a fake scheduler."""

from __future__ import annotations

import asyncio

import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.runtime import ServiceRuntime

pytestmark = pytest.mark.adapter

TIMEOUT = 10.0


@pytest.mark.asyncio
async def test_the_executor_answers_info_and_steps_on_a_tiny_model(bus, tmp_path):
    """The executor's real handlers over a tiny generated GGUF (no default model): its cache
    geometry, then a prefill and a decode step with greedy tokens."""
    from llmbus.bus.messages import (
        ExecutorInfo,
        ExecutorInfoRequest,
        NewRequestData,
        ScheduledRequest,
        StepPlan,
        StepResult,
    )
    from llmbus.services.cli import build_parser
    from llmbus.services.executor import service as executor_service
    from tests.gguf_fixtures import GREEDY, write_tiny_llama

    url, client = bus
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model, quantized="Q4_1")
    args = build_parser().parse_args(["serve", "executor", "--model", str(model),
                                      "--num-blocks", "16", "--block-size", "4",
                                      "--threads", "1", "--shutdown-timeout", "0"])
    async with ServiceRuntime("executor", url, handle_signals=False) as runtime:
        choice = executor_service.backend_choice_for(args, cuda_available=False)
        serving = asyncio.create_task(executor_service.serve(args, runtime, choice))

        async def ask(subject, message, reply_type):
            async with asyncio.timeout(120):  # the first call waits for the model to load
                while True:
                    try:
                        reply = await client.request(subject, encode(message), timeout=5)
                        return decode(reply.data, reply_type)
                    except nats.errors.NoRespondersError:
                        await asyncio.sleep(0.1)

        info = await ask(subjects.executor_info("engine0"), ExecutorInfoRequest(), ExecutorInfo)
        assert (info.num_blocks, info.block_size) == (16, 4)
        prefill = StepPlan(step_id=0, new_requests=[NewRequestData("r", [5, 6, 7], GREEDY)],
                           scheduled=[ScheduledRequest("r", 0, 3, [1])])
        decode_step = StepPlan(step_id=1, scheduled=[ScheduledRequest("r", 3, 1)])
        first = await ask(subjects.executor_step("engine0"), prefill, StepResult)
        second = await ask(subjects.executor_step("engine0"), decode_step, StepResult)
        assert first.error == second.error == ""
        assert len(first.sampled_token_ids) == len(second.sampled_token_ids) == 1
        assert first.batch_size == second.batch_size == 1 and first.num_tokens == 3
        runtime.stop_event.set()
        await serving


def test_an_executor_refuses_a_file_it_cannot_serve_in_one_line(bus, tmp_path):
    """An architecture the loader does not know ends the executor with one line naming the
    file and the reason, not a traceback in its log."""
    import subprocess
    import sys

    from llmbus.services.executor.weights.model_config import SUPPORTED_ARCHITECTURES
    from tests.gguf_fixtures import write_tiny_llama

    url, _ = bus
    model = tmp_path / "other.gguf"
    write_tiny_llama(model, arch="phi3")
    result = subprocess.run([sys.executable, "-m", "llmbus.services.cli", "serve", "executor",
                             "--model", str(model), "--nats-url", url, "--threads", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "llmbus executor: other.gguf: unsupported model architecture 'phi3'; supported: "
        f"{SUPPORTED_ARCHITECTURES}")

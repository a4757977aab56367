"""LoRA adapters served by the whole pipeline: conftest's two engines (exact mode, adapters on),
an adapter loaded at run time through the api, its bytes from the bus's store on every engine,
its greedy output equal to transformers + PEFT (the PEFT folder and the same adapter as a GGUF),
the base's output unchanged beside it, and unloading it under load with no request failed."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.messages import Heartbeat
from llmbus.services.executor.weights.model_config import read_config
from llmbus.services.gguf_metadata import read_layout
from llmbus.services.model_files import default_model_path
from tests.lora_adapters import with_peft, write_gguf_adapter, write_peft_adapter
from tests.stack import AUTH, MODEL_NAME, needs_default_model

pytestmark = [pytest.mark.model, needs_default_model()]
PROMPT = "The best way to learn a new language is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def lora_stack(two_of_each, tmp_path_factory):
    """The two engines' api and observer URLs, and an adapter folder and GGUF for the model."""
    stack, root, url = two_of_each
    folder = tmp_path_factory.mktemp("lora") / "tuned"
    weights = write_peft_adapter(folder, default_model_path(), rank=8, seed=11)
    layout = read_layout(default_model_path())
    config = read_config(layout.metadata, {t.name: t.info.shape for t in layout.tensors})
    as_gguf = write_gguf_adapter(folder.parent / "tuned.gguf", weights, "llama", alpha=16,
                                 config=config)
    return f"{root}/v1", stack.observer_url(url), folder, as_gguf


async def _engines_holding(nats_url: str, adapter: str, timeout: float) -> set[str]:
    """The engines whose executor heartbeats list `adapter` within `timeout` (both, or what
    was seen by then)."""
    nc = await nats.connect(nats_url)
    holding: dict[str, bool] = {}

    async def on_beat(msg) -> None:
        beat = msgspec.msgpack.decode(msg.data, type=Heartbeat)
        holding[beat.engine_id] = adapter in beat.adapters

    await nc.subscribe(subjects.heartbeat("executor"), cb=on_beat)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (len(holding) >= 2 and all(holding.values())):
        await asyncio.sleep(0.1)
    await nc.close()
    return {engine for engine, held in holding.items() if held}


def _complete(http: httpx.Client, model: str, prompt=PROMPT) -> httpx.Response:
    return http.post("/completions", json={"model": model, "prompt": prompt, "temperature": 0,
                                            "max_tokens": MAX_TOKENS})


def _peft_text(hf_reference, folder) -> str:
    import torch

    tokenizer, model = hf_reference
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        out = with_peft(model, folder).generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_an_adapter_loaded_at_run_time_serves_on_every_engine_as_peft_computes(
        lora_stack, hf_reference):
    base_url, observer, folder, as_gguf = lora_stack
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=120) as http:
        base_before = _complete(http, MODEL_NAME).json()["choices"][0]["text"]
        started = time.monotonic()
        for name, path in (("tuned", folder), ("tuned-gguf", as_gguf)):
            loaded = http.post("/load_lora_adapter", json={"lora_name": name,
                                                           "lora_path": str(path)})
            assert loaded.status_code == 200, loaded.text
        assert asyncio.run(_engines_holding(observer, "tuned", 5.0)) == {"engine0", "engine1"}
        assert time.monotonic() - started < 5 + 10  # both loads, every engine answered
        models = {m["id"]: m for m in http.get("/models").json()["data"]}
        assert models["tuned"]["parent"] == models[MODEL_NAME]["id"]
        expected = _peft_text(hf_reference, folder)
        replies = [_complete(http, model) for model in ("tuned", "tuned-gguf", MODEL_NAME)]
        texts = [r.json()["choices"][0]["text"] for r in replies]
        assert texts == [expected, expected, base_before]
        assert expected != base_before


def test_unloading_under_load_fails_no_request_and_frees_the_adapter(lora_stack):
    base_url, observer, folder, _ = lora_stack

    async def run() -> tuple[list[int], int, int]:
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=120) as http:
            loaded = await http.post("/load_lora_adapter", json={"lora_name": "brief",
                                                                 "lora_path": str(folder)})
            assert loaded.status_code == 200, loaded.text

            async def one(model: str) -> int:
                reply = await http.post("/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True})
                return reply.status_code

            streams = [asyncio.create_task(one(m)) for m in ["brief", MODEL_NAME] * 3]
            await asyncio.sleep(0.5)
            unloaded = await http.post("/unload_lora_adapter", json={"lora_name": "brief"})
            statuses = await asyncio.gather(*streams)
            after = await http.post("/completions", json={"model": "brief", "prompt": "x"})
            return statuses, unloaded.status_code, after.status_code

    statuses, unloaded, after = asyncio.run(run())
    assert statuses == [200] * 6  # the adapter's requests already admitted finished on it
    assert (unloaded, after) == (200, 404)
    assert asyncio.run(_engines_holding(observer, "brief", 3.0)) == set()

"""LoRA adapters through the api, without the model: the real app on a real nats-server with
JetStream and the services' users (tests/lora_fakes.py stands in for the other stages). What
`/v1/models` lists; which adapter a request's `model` picks on every generating route; one api
copy serving what another loaded, and dropping what another unloaded within a second; the
per-adapter metrics."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from tests.bus_users import connect_as
from tests.lora_fakes import MODEL, LoraWorld, lora_world, wait_for_engines, write_adapter

pytestmark = pytest.mark.adapter  # a real nats-server, no model

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def world(monkeypatch):
    async with lora_world(connect_as(monkeypatch)) as made:
        yield made


async def _loaded(world: LoraWorld, http, tmp_path, name: str) -> None:
    await wait_for_engines(http, {"e1"})
    response = await http.post("/v1/load_lora_adapter", json={
        "lora_name": name, "lora_path": write_adapter(tmp_path / name.replace("/", "_"))})
    assert response.status_code == 200, response.text


async def test_models_lists_the_base_and_every_adapter(world, tmp_path):
    await world.engine("e1")
    http = await world.api()
    base = {"id": MODEL, "object": "model", "created": 0, "owned_by": "llmbus", "root": MODEL,
            "parent": None, "max_model_len": 64}
    assert (await http.get("/v1/models")).json() == {"object": "list", "data": [base]}
    for name in ("sql-lora", "org/poet@v2"):
        await _loaded(world, http, tmp_path, name)
    listed = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == [MODEL, "org/poet@v2", "sql-lora"]
    assert listed[2] == base | {"id": "sql-lora", "parent": MODEL}
    assert (await http.get("/v1/models/org/poet@v2")).json()["parent"] == MODEL
    assert (await http.get(f"/v1/models/{MODEL}")).json() == base
    missing = await http.get("/v1/models/gpt-9")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


async def _generate(http, route: str, model: str):
    body = ({"model": model, "input": "hi", "max_output_tokens": 5} if route == "/v1/responses"
            else {"model": model, "prompt": "hi", "max_tokens": 5}
            if route == "/v1/completions"
            else {"model": model, "messages": HELLO, "max_tokens": 5})
    return await http.post(route, json=body)


GENERATING = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


@pytest.mark.parametrize("route", GENERATING)
async def test_the_model_picks_the_adapter_on_every_generating_route(world, tmp_path, route):
    """The base's name generates with the base, an adapter's with that adapter (and the
    response names it); any other name is a 404, in the route's own error dialect."""
    await world.engine("e1")
    http = await world.api()
    await _loaded(world, http, tmp_path, "sql-lora")
    for model, adapter in ((MODEL, ""), ("sql-lora", "sql-lora")):
        response = await _generate(http, route, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        assert world.pipeline.requests[-1].params.adapter == adapter
    num_sent = len(world.pipeline.requests)
    missing = await _generate(http, route, "gpt-9")
    assert missing.status_code == 404, missing.text
    error = missing.json()["error"]
    assert "gpt-9" in error["message"]
    assert error["type"] == "not_found_error"
    assert error.get("code", "model_not_found") == "model_not_found"  # Anthropic's has none
    assert len(world.pipeline.requests) == num_sent


async def test_embeddings_and_tokenize_take_an_adapter_as_its_base(world, tmp_path):
    """Embeddings come from the base alone: an adapter's name is refused by name (not
    silently embedded by the base); tokenizing with an adapter's name is the base's."""
    await world.engine("e1")
    http = await world.api()
    await _loaded(world, http, tmp_path, "sql-lora")
    refused = await http.post("/v1/embeddings", json={"model": "sql-lora", "input": "hi"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "model_not_supported"
    missing = await http.post("/v1/embeddings", json={"model": "gpt-9", "input": "hi"})
    assert missing.status_code == 404


async def test_an_adapter_loaded_through_one_copy_serves_through_another(world, tmp_path):
    """Copy A loads: copy B serves it on its next request. Copy A unloads: B, which served it
    a moment ago, refuses it within about a second (it trusts a hit that long)."""
    await world.engine("e1")
    copy_a, copy_b = await world.api(), await world.api()
    await wait_for_engines(copy_b, {"e1"})
    assert (await _generate(copy_b, "/v1/completions", "sql-lora")).status_code == 404
    await _loaded(world, copy_a, tmp_path, "sql-lora")
    assert (await _generate(copy_b, "/v1/completions", "sql-lora")).status_code == 200
    assert (await copy_a.post("/v1/unload_lora_adapter",
                              json={"lora_name": "sql-lora"})).status_code == 200
    assert (await _generate(copy_a, "/v1/completions", "sql-lora")).status_code == 404
    unloaded_at = time.monotonic()
    while (await _generate(copy_b, "/v1/completions", "sql-lora")).status_code == 200:
        assert time.monotonic() - unloaded_at < 1.5, "copy B served a deleted adapter"
        await asyncio.sleep(0.05)


def _samples(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^{re.escape(name)}\{{[^}}]*lora_name="([^"]+)"[^}}]*\}} (\S+)$', text, re.MULTILINE)}


async def test_requests_and_tokens_are_counted_per_adapter(world, tmp_path):
    await world.engine("e1")
    http = await world.api()
    for name in ("sql-lora", "poet"):
        await _loaded(world, http, tmp_path, name)
    for model in ("sql-lora", "sql-lora", "poet", MODEL):
        assert (await _generate(http, "/v1/chat/completions", model)).status_code == 200
    text = (await http.get("/metrics")).text
    assert _samples(text, "llmbus:lora_requests_total") == {"sql-lora": 2, "poet": 1}
    assert _samples(text, "llmbus:lora_prompt_tokens_total") == {"sql-lora": 6, "poet": 3}
    assert _samples(text, "llmbus:lora_generation_tokens_total") == {"sql-lora": 4, "poet": 2}
    await http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    text = (await http.get("/metrics")).text
    assert _samples(text, "llmbus:lora_requests_total") == {"sql-lora": 2}


async def test_the_pipeline_view_shows_each_engines_resident_adapters(world, tmp_path):
    engine = await world.engine("e1")
    http = await world.api()
    await _loaded(world, http, tmp_path, "sql-lora")
    assert engine.resident["sql-lora"].startswith(json.dumps({"r": 8, "lora_alpha": 16}).encode())
    async with asyncio.timeout(5):  # its next heartbeat says so
        while True:
            view = (await http.get("/v1/pipeline")).json()
            [executors] = [s for s in view["stages"] if s["name"] == "executor"]
            if executors["copies"][0]["adapters"] == ["sql-lora"]:
                break
            await asyncio.sleep(0.1)

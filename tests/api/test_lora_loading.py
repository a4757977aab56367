"""Loading and unloading LoRA adapters at run time (vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`), without the model: the real app on a real nats-server with
JetStream and the services' users, engines answering AdapterCommand as executors will
(tests/lora_fakes.py). What succeeds, and every way it is refused: a path that is not there, a
file that is no adapter, an engine that refuses it, no engine serving adapters, a name taken,
an unknown unload; nothing refused stays in the store."""

from __future__ import annotations

import pytest

from tests.bus_users import connect_as
from tests.lora_fakes import KEY, MODEL, lora_world, wait_for_engines, write_adapter

pytestmark = pytest.mark.adapter  # a real nats-server, no model

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture
async def world(monkeypatch):
    async with lora_world(connect_as(monkeypatch)) as made:
        yield made


def _error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    return error


async def _models(http) -> list[str]:
    return [m["id"] for m in (await http.get("/v1/models")).json()["data"]]


async def test_load_then_unload_answers_as_vllm_and_tells_every_engine(world, tmp_path):
    """Both engines read the adapter from the store (bytes the packer made of the folder);
    the answers are vLLM's plain text; unloading tells every engine too."""
    engines = [await world.engine("e1"), await world.engine("e2")]
    http = await world.api()
    await wait_for_engines(http, {"e1", "e2"})
    path = write_adapter(tmp_path / "sql", weights=b"\x01\x02")
    response = await http.post(LOAD, json={"lora_name": "sql-lora", "lora_path": path})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == "Success: LoRA adapter 'sql-lora' added successfully."
    assert all(e.resident["sql-lora"].endswith(b"\n\x01\x02") for e in engines)
    assert await _models(http) == [MODEL, "sql-lora"]
    response = await http.post(UNLOAD, json={"lora_name": "sql-lora"})
    assert response.text == "Success: LoRA adapter 'sql-lora' removed successfully."
    assert [e.commands for e in engines] == [[("load", "sql-lora"), ("unload", "sql-lora")]] * 2
    assert await _models(http) == [MODEL]


async def test_a_path_that_is_not_there_is_a_400_naming_it(world, tmp_path):
    await world.engine("e1")
    http = await world.api()
    missing = str(tmp_path / "nowhere")
    error = _error(await http.post(LOAD, json={"lora_name": "x", "lora_path": missing}), 400,
                   "lora_path")
    assert missing in error["message"]
    unreadable = write_adapter(tmp_path / "locked")
    (tmp_path / "locked" / "adapter_model.bin").unlink()
    (tmp_path / "locked" / "adapter_model.bin").mkdir()  # reading it: IsADirectoryError
    error = _error(await http.post(LOAD, json={"lora_name": "x", "lora_path": unreadable}),
                   400, "lora_path")
    assert unreadable in error["message"]
    assert await _models(http) == [MODEL]


async def test_a_file_that_is_no_adapter_is_a_400_with_the_readers_line(world, tmp_path):
    engine = await world.engine("e1")
    http = await world.api()
    path = write_adapter(tmp_path / "bad", rank="eight")
    error = _error(await http.post(LOAD, json={"lora_name": "bad", "lora_path": path}), 400,
                   "lora_path")
    assert error["message"] == "bad/adapter_config.json: `r` must be a rank of 1 or more, " \
                               "not 'eight'"
    assert engine.commands == [] and await _models(http) == [MODEL]


async def test_an_engine_that_refuses_undoes_the_load(world, tmp_path):
    """One engine of two refuses: the client reads which and why, the store no longer has
    the adapter, and the engine that took it is told to drop it."""
    willing = await world.engine("e1")
    await world.engine("e2", refuse="lora_B of layer 3 is 576x16, the base wants 960x16")
    http = await world.api()
    await wait_for_engines(http, {"e1", "e2"})
    path = write_adapter(tmp_path / "misfit")
    error = _error(await http.post(LOAD, json={"lora_name": "misfit", "lora_path": path}), 400,
                   "lora_path")
    assert error["message"] == "engine e2: lora_B of layer 3 is 576x16, the base wants 960x16"
    assert willing.commands == [("load", "misfit"), ("unload", "misfit")]
    assert "misfit" not in willing.resident and await _models(http) == [MODEL]
    chat = await http.post("/v1/chat/completions", json={
        "model": "misfit", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 404


async def test_no_engine_serving_adapters_is_a_400_saying_how(world, tmp_path):
    await world.engine("e1", enabled=False)
    http = await world.api()
    await wait_for_engines(http, {"e1"})
    path = write_adapter(tmp_path / "sql")
    error = _error(await http.post(LOAD, json={"lora_name": "sql", "lora_path": path}), 400,
                   "lora_name")
    assert "--enable-lora" in error["message"]
    assert await _models(http) == [MODEL]


async def test_no_engine_at_all_is_a_503(world, tmp_path):
    http = await world.api()
    response = await http.post(LOAD, json={"lora_name": "sql",
                                           "lora_path": write_adapter(tmp_path / "sql")})
    _error(response, 503, None)
    assert response.headers["retry-after"] == "1"
    assert await _models(http) == [MODEL]


async def test_names_taken_or_malformed_are_refused(world, tmp_path):
    """A loaded name (vLLM: already loaded), the base's own name, a name that is no model id;
    and the store keeps the first adapter as it was."""
    engine = await world.engine("e1")
    http = await world.api()
    await wait_for_engines(http, {"e1"})
    first = write_adapter(tmp_path / "one", weights=b"first")
    second = write_adapter(tmp_path / "two", weights=b"second")
    assert (await http.post(LOAD, json={"lora_name": "sql", "lora_path": first})).status_code \
        == 200
    for name, says in (("sql", "already been loaded"), (MODEL, "base model"),
                       ("a b", "not an adapter name")):
        error = _error(await http.post(LOAD, json={"lora_name": name, "lora_path": second}),
                       400, "lora_name")
        assert says in error["message"]
    assert engine.commands == [("load", "sql")]
    assert await engine.store.get("sql") == engine.resident["sql"]
    assert engine.resident["sql"].endswith(b"first")


async def test_unloading_an_unknown_adapter_is_a_404(world):
    http = await world.api()
    error = _error(await http.post(UNLOAD, json={"lora_name": "ghost"}), 404, "lora_name")
    assert "ghost" in error["message"] and error["code"] == "model_not_found"


@pytest.mark.parametrize(("body", "param"), [
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": "x", "lora_path": "/p", "lora_pth": "/p"}, "lora_pth"),
    ({"lora_name": "x", "lora_path": "/p", "load_inplace": True}, "load_inplace")])
async def test_malformed_bodies_are_400s(world, body, param):
    http = await world.api()
    _error(await http.post(LOAD, json=body), 400, param)


async def test_both_routes_need_the_api_key(world, tmp_path):
    http = await world.api()
    path = write_adapter(tmp_path / "sql")
    for route, body in ((LOAD, {"lora_name": "sql", "lora_path": path}),
                        (UNLOAD, {"lora_name": "sql"})):
        for headers in ({"Authorization": ""}, {"Authorization": f"Bearer {KEY}x"}):
            _error(await http.post(route, json=body, headers=headers), 401, None)

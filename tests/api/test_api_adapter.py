"""The api adapter without the model: the real app and EngineClient on a real nats-server, with
fake stages answering on the bus (admission, deltas, model info, stats, pings). The 400 table,
engine refusals, auth, streaming and /metrics, in seconds rather than through the whole stack."""

from __future__ import annotations

import json

import httpx
import nats
import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import (
    Admission,
    DeltaBatch,
    EngineStats,
    EngineStatsRequest,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    ModelInfo,
    Ping,
    Pong,
    ResumedCompletion,
    TextDelta,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.api.app import ApiSettings, create_app
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.api.service import answer_metrics
from llmbus.services.api.stats_bus import PIPELINE_STAGES
from llmbus.services.launcher import Stack
from tests.served_app import served

pytestmark = pytest.mark.adapter  # a real nats-server, no model

MODEL = "tiny"
KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "hello"}]


class FakeStages:
    """Answers as the tokenizer, the engine and every stage would; streams 'Hello world'."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def start(self, url: str) -> None:
        self.nc = await nats.connect(url)
        await self.nc.subscribe(subjects.TOKENIZER_GENERATE, cb=self.on_generate)
        await self.nc.subscribe(subjects.ENGINE_MODEL, cb=self.on_model)
        await self.nc.subscribe(subjects.ENGINE_STATS, cb=self.on_stats)
        for stage in PIPELINE_STAGES:
            await self.nc.subscribe(subjects.ping(stage), cb=self.on_ping)
        await self.nc.flush()

    async def on_generate(self, msg) -> None:
        request = decode(msg.data, GenerateRequest)
        self.requests.append(request)
        text = request.prompt or request.messages[-1].content
        if "overload" in text:
            await msg.respond(encode(Admission(error_code=ErrorCode.OVERLOADED,
                                               error_message="the engine's queue is full")))
            return
        if "too long" in text:
            await msg.respond(encode(Admission(
                error_code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, error_param="messages",
                error_message="this model's maximum context length is 64 tokens")))
            return
        await msg.respond(encode(Admission(num_prompt_tokens=3, scheduler_instance_id="s")))
        if "keeps failing" in text:  # one token, then its engine fails it, every attempt
            items = [TextDelta(request_id=request.request_id, text="Hello", token_ids=[100],
                               num_new_tokens=1, num_output_tokens=1)] if not request.attempt \
                else []
            items.append(TextDelta(request_id=request.request_id, text="",
                                   finish_reason=FinishReason.ERROR, resumable=True,
                                   error="engine e0's executor failed: boom",
                                   attempt=request.attempt, num_output_tokens=1))
            await self.nc.publish(request.reply_subject, encode(DeltaBatch(items=items)))
            return
        deltas = [("Hello", FinishReason.NONE), (" world", FinishReason.LENGTH)]
        for step, (piece, reason) in enumerate(deltas):
            await self.nc.publish(request.reply_subject, encode(DeltaBatch(items=[TextDelta(
                request_id=request.request_id, text=piece, num_new_tokens=1,
                finish_reason=reason, num_prompt_tokens=3, num_output_tokens=step + 1,
                token_ids=[100 + step])])))

    async def on_model(self, msg) -> None:
        await msg.respond(encode(ModelInfo(model_name=MODEL, max_model_len=64, engine_id="e0")))

    async def on_stats(self, msg) -> None:
        decode(msg.data, EngineStatsRequest)
        await msg.respond(encode(EngineStats(
            engine_id="e0", num_steps=5, num_running=1, num_waiting=0, num_free_blocks=10,
            num_total_blocks=16, max_batch_size=2, num_preemptions=0, num_finished=3)))

    async def on_ping(self, msg) -> None:
        decode(msg.data, Ping)
        await msg.respond(encode(Pong(service="x", instance_id="x")))


@pytest.fixture
async def client():
    """An HTTP client to the app served by uvicorn in this event loop (the bus client lives
    in it too)."""
    stack = Stack()
    url = stack.start_nats(auth=False)
    stages = FakeStages()
    await stages.start(url)
    try:
        async with ServiceRuntime("api", url, handle_signals=False) as runtime:
            engine = EngineClient(runtime, request_timeout=10.0)
            await engine.start()
            app = create_app(engine, ApiSettings(api_key=KEY))
            await answer_metrics(runtime, app)
            async with served(app) as root, httpx.AsyncClient(base_url=root,
                                                              timeout=30) as http:
                http.stages = stages
                yield http
    finally:
        await stages.nc.close()
        stack.stop()


def _error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param
    return error


CASES = [
    ("malformed json", b'{"model": ', None),
    ("body not an object", b"[1, 2]", None),
    ("missing messages", {"model": MODEL}, "messages"),
    ("unknown role", {"model": MODEL, "messages": [{"role": "x", "content": "a"}]}, "messages"),
    ("max_tokens zero", {"model": MODEL, "messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ("temperature out of range", {"model": MODEL, "messages": HELLO, "temperature": 7},
     "temperature"),
    ("n as a string", {"model": MODEL, "messages": HELLO, "n": "two"}, "n"),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": HELLO, "top_logprobs": 2},
     "top_logprobs"),
    ("stream_options without stream", {"model": MODEL, "messages": HELLO,
                                       "stream_options": {"include_usage": True}},
     "stream_options"),
    ("unsupported parameter", {"model": MODEL, "messages": HELLO,
                               "tools": [{"type": "function"}]}, "tools"),
    ("refused by the engine: context length", {"model": MODEL, "messages": [
        {"role": "user", "content": "too long"}]}, "messages"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "body", "param"), CASES, ids=[c[0] for c in CASES])
async def test_bad_input_is_a_400_with_openai_error(client, name, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = await client.post("/v1/chat/completions", headers=AUTH, **kwargs)
    error = _error(response, 400, param)
    assert error["type"] == "invalid_request_error"
    if name.startswith("refused"):
        assert error["code"] == "context_length_exceeded"


@pytest.mark.asyncio
async def test_an_unknown_model_is_a_404(client):
    error = _error(await client.post("/v1/chat/completions", headers=AUTH,
                                     json={"model": "gpt-9", "messages": HELLO}), 404, "model")
    assert (error["type"], error["code"]) == ("not_found_error", "model_not_found")
    assert client.stages.requests == []


@pytest.mark.asyncio
async def test_an_overloaded_engine_is_a_503_with_retry_after(client):
    response = await client.post("/v1/completions", headers=AUTH,
                                 json={"model": MODEL, "prompt": "overload"})
    _error(response, 503, None)
    assert response.headers["retry-after"] == "1"


@pytest.mark.asyncio
async def test_the_key_is_required_on_v1(client):
    body = {"model": MODEL, "messages": HELLO}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k"}):
        error = _error(await client.post("/v1/chat/completions", json=body, headers=headers),
                       401, None)
        assert error["code"] == "invalid_api_key"
    assert (await client.post("/v1/chat/completions", json=body, headers=AUTH)).status_code \
        == 200
    assert client.stages.requests[-1].messages[0].content == "hello"


@pytest.mark.asyncio
async def test_a_request_its_engines_keep_failing_moves_up_to_the_migration_limit(client):
    """Each attempt fails with a resumable error: the api resumes it (from the one token its
    client has) as attempts 1, 2 and 3, then gives the client the error, naming what failed
    and that it gave up."""
    response = await client.post("/v1/completions", headers=AUTH,
                                 json={"model": MODEL, "prompt": "keeps failing"})
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "engine e0's executor failed: boom" in message
    assert "gave up after 3 migrations" in message
    requests = client.stages.requests
    assert [r.attempt for r in requests] == [0, 1, 2, 3]
    assert all(r.resumed == [ResumedCompletion(0, [100])] for r in requests[1:])


@pytest.mark.asyncio
async def test_a_stream_arrives_as_openai_chunks(client):
    response = await client.post("/v1/chat/completions", headers=AUTH, json={
        "model": MODEL, "messages": HELLO, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    events = [line[5:].strip() for line in response.text.splitlines()
              if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c["choices"])
    assert text == "Hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                   "total_tokens": 5,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.asyncio
async def test_metrics_and_health_without_the_model(client):
    await client.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "hi"})
    text = (await client.get("/metrics")).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    engine = '{model_name="tiny",replica="e0"}'
    assert samples["llmbus:num_requests_running" + engine] == 1
    assert samples["llmbus:kv_cache_usage_perc" + engine] == 0.375
    assert samples["llmbus:num_preemptions_total" + engine] == 0
    [finished] = [v for k, v in samples.items() if k.startswith("llmbus:request_success_total{")
                  and 'finished_reason="length"' in k]
    [generated] = [v for k, v in samples.items()
                   if k.startswith("llmbus:generation_tokens_total{")]
    assert (finished, generated) == (1, 2)
    assert "# TYPE llmbus:prefix_cache_hits_total counter" in text
    health = (await client.get("/health")).json()
    assert health["status"] == "ok" and set(health["stages"]) == set(PIPELINE_STAGES)

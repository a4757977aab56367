"""The tokenizer's bus adapter without the default model: its real handlers on a real
nats-server, a tiny vocabulary, and a fake engine."""

from __future__ import annotations

import pytest

from llmbus.bus import subjects
from llmbus.bus.codec import decode, encode
from llmbus.bus.messages import (
    Admission,
    DecodeRequest,
    DecodeResult,
    EncodeRequest,
    EncodeResult,
    ErrorCode,
    GenerateRequest,
    SamplingParams,
    SubmitRequest,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.tokenizer.router import Router
from llmbus.services.tokenizer.service import TokenizerService
from llmbus.services.tokenizer.tokenization import Tokenization
from tests.gguf_fixtures import tiny_tokenizer

pytestmark = pytest.mark.adapter

TIMEOUT = 10.0


@pytest.mark.asyncio
async def test_the_tokenizer_admits_into_an_engine_and_answers_encode_and_decode(bus):
    url, client = bus
    submitted: list[SubmitRequest] = []

    async def engine(msg) -> None:  # any engine (no heartbeat yet: the shared subject)
        submitted.append(decode(msg.data, SubmitRequest))
        await msg.respond(encode(Admission(num_prompt_tokens=len(
            submitted[-1].prompt_token_ids), scheduler_instance_id="s1")))

    await client.subscribe(subjects.ENGINE_SUBMIT, cb=engine)
    await client.flush()
    tokenization = Tokenization(tiny_tokenizer())
    async with ServiceRuntime("tokenizer", url, handle_signals=False) as runtime:
        await TokenizerService(runtime, tokenization, Router()).subscribe()

        async def ask(subject, message, reply_type):
            reply = await client.request(subject, encode(message), timeout=TIMEOUT)
            return decode(reply.data, reply_type)

        admission = await ask(subjects.TOKENIZER_GENERATE, GenerateRequest(
            request_id="r", reply_subject="api.x", model="m", params=SamplingParams(),
            prompt="hello", attempt=1, avoid_detokenizer_ids=["d2"]), Admission)
        hello = tokenization.tokenizer.encode("hello")
        assert admission.error_code == ErrorCode.NONE and admission.num_prompt_tokens == 2
        assert submitted[0].prompt_token_ids == [0, *hello] and submitted[0].arrival_time > 0
        # a migration's attempt and the detokenizer copies its api took for dead, passed on
        assert (submitted[0].attempt, submitted[0].avoid_detokenizer_ids) == (1, ["d2"])
        refused = await ask(subjects.TOKENIZER_GENERATE, GenerateRequest(
            request_id="r2", reply_subject="api.x", model="m",
            params=SamplingParams(logit_bias={999: 1.0}), prompt="hello"), Admission)
        assert (refused.error_code, refused.error_param) == (ErrorCode.INVALID_REQUEST,
                                                             "logit_bias")
        assert len(submitted) == 1  # refused before any engine saw it
        encoded = await ask(subjects.TOKENIZER_ENCODE, EncodeRequest(prompt="hello"),
                            EncodeResult)
        assert encoded.token_ids == [0, *hello]
        decoded = await ask(subjects.TOKENIZER_DECODE, DecodeRequest(token_ids=hello),
                            DecodeResult)
        assert decoded.text == "hello"
        bad = await ask(subjects.TOKENIZER_DECODE, DecodeRequest(token_ids=[10**6]),
                        DecodeResult)
        assert "outside the vocabulary" in bad.error_message

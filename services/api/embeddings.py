"""`/v1/embeddings` and `/v1/score`: inputs pooled into vectors by the pipeline.

Each input is one pipeline request (api -> tokenizer -> scheduler -> executor, and back from
the scheduler: no detokenizer), with `SamplingParams.pooling` set: its prompt is computed like
any prefill, beside other requests' decodes, and its final hidden states pooled (the model's
pooling: the GGUF's `pooling_type`, or mean). The vectors come back raw; normalising (on by
default, as OpenAI's are unit vectors), `dimensions` (the first N components, renormalised, as
Matryoshka models expect) and the encoding are done here. `/v1/score` (vLLM's name) is the
cosine of two inputs' embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import msgspec
import numpy as np
from litestar import Request, post
from litestar.datastructures import State
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from llmbus.bus.messages import (
    EncodeRequest,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TextDelta,
)
from llmbus.services.api.bodies import Int, decode_body, prompt_items
from llmbus.services.api.chat import check_model, metrics_for
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.api.errors import OpenAIError, bad_request
from llmbus.services.api.openapi import body_of

DEFAULT_MAX_INPUTS = 2048  # OpenAI's limit per request
IN_FLIGHT = 32  # inputs of one call in the pipeline at once (the scheduler queues 256)
_tracer = trace.get_tracer("llmbus.api")


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    # str | list[str] | list[int] | list[list[int]]: checked by `inputs_of`
    input: str | list[Any]
    encoding_format: str = "float"
    dimensions: Int | None = None
    user: str | None = None
    normalize: bool = True  # vLLM's extension: False gives the pooled vector as it is
    truncate_prompt_tokens: Int | None = None  # vLLM's: keep only the last N tokens


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int | None = None


def inputs_of(value: str | list[Any], max_inputs: int,
              param: str = "input") -> list[str | list[int]]:
    """The inputs of a request: each a non-empty string or a non-empty list of token ids."""
    return prompt_items(value, param, max_inputs, " (--max-embedding-inputs)")


def finish_vectors(vectors: np.ndarray, *, normalize: bool, dimensions: int | None) -> np.ndarray:
    """[B, D] pooled vectors as the client asked: the first `dimensions` components, then L2
    normalised (unless `normalize` is off)."""
    if dimensions is not None:
        if not 1 <= dimensions <= vectors.shape[1]:
            raise bad_request(f"`dimensions` must be between 1 and the model's "
                              f"{vectors.shape[1]}, got {dimensions}", param="dimensions")
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors.astype(np.float32)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # float32 little-endian, as the openai SDK decodes it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


async def embed(engine: EngineClient, model: str, inputs: list[str | list[int]],
                truncate: int | None) -> tuple[np.ndarray, int]:
    """The pooled vectors [B, D] of the inputs, and their prompt tokens in all.

    At most `IN_FLIGHT` inputs of one call are in the pipeline at once, the next admitted as
    each one's vector comes back: a call of 2,048 inputs neither overflows the scheduler's
    queue (a 503 on an idle server) nor fills it ahead of every other client."""
    if truncate is not None and truncate < 1:
        raise bad_request("`truncate_prompt_tokens` must be at least 1",
                          param="truncate_prompt_tokens")
    base, queue = f"embd-{uuid.uuid4().hex}", asyncio.Queue[TextDelta]()
    ids = [f"{base}-{i}" for i in range(len(inputs))]
    to_admit = iter(zip(ids, inputs, strict=True))
    admitted: list[str] = []  # submitted, in fact: each is released (aborted) on leaving
    num_prompt_tokens = 0

    async def admit_next() -> None:
        nonlocal num_prompt_tokens
        request_id, item = next(to_admit)
        admitted.append(request_id)
        admission = await engine.submit(GenerateRequest(
            request_id=request_id, reply_subject=engine.reply_subject, model=model,
            params=SamplingParams(max_tokens=1, pooling="model"), n=1,
            **await _source(engine, item, truncate)), queue)
        num_prompt_tokens += admission.num_prompt_tokens

    vectors: dict[str, bytes] = {}
    finished = False
    try:
        first = await asyncio.gather(*(admit_next() for _ in range(min(IN_FLIGHT, len(ids)))),
                                     return_exceptions=True)
        if errors := [e for e in first if isinstance(e, BaseException)]:
            raise errors[0]
        async for delta in engine.deltas(queue, len(ids)):
            if delta.finish_reason != FinishReason.STOP or not delta.embedding:
                raise OpenAIError(500, f"embedding failed: {delta.error or 'aborted'}")
            vectors[delta.request_id] = delta.embedding
            if len(admitted) < len(ids):
                await admit_next()
        finished = True
    except OpenAIError as exc:
        if exc.param == "prompt":
            exc.param = "input"  # this API's name for it
        raise
    finally:
        await engine.release(admitted, finished)
    rows = [np.frombuffer(vectors[request_id], dtype="<f4") for request_id in ids]
    return np.stack(rows), num_prompt_tokens


async def _source(engine: EngineClient, item: str | list[int],
                  truncate: int | None) -> dict[str, Any]:
    """An input as the GenerateRequest carries it; truncated, it is tokenized here first."""
    if truncate is None:
        return {"prompt": item} if isinstance(item, str) else {"prompt_token_ids": item}
    if isinstance(item, str):
        item = await engine.encode(EncodeRequest(prompt=item))
    return {"prompt_token_ids": item[-truncate:]}


@post("/embeddings", status_code=200, opt=body_of(EmbeddingRequest))
async def embeddings(request: Request, state: State) -> dict:
    req = decode_body(await request.body(), EmbeddingRequest)
    if req.encoding_format not in ("float", "base64"):
        raise bad_request("`encoding_format` must be `float` or `base64`",
                          param="encoding_format")
    engine: EngineClient = state.engine
    model = await check_model(state, req.model)
    inputs = inputs_of(req.input, state.settings.max_embedding_inputs)
    started = time.monotonic()
    with _tracer.start_as_current_span("embeddings", kind=SpanKind.SERVER, attributes={
            "gen_ai.operation.name": "embeddings", "gen_ai.request.model": model,
            "llmbus.num_inputs": len(inputs)}) as span:  # every input's request joins it
        vectors, num_tokens = await embed(engine, model, inputs, req.truncate_prompt_tokens)
        span.set_attribute("gen_ai.usage.input_tokens", num_tokens)
    vectors = finish_vectors(vectors, normalize=req.normalize, dimensions=req.dimensions)
    metrics_for(state, model).observe_embeddings(len(inputs), num_tokens,
                                                 time.monotonic() - started)
    engine.runtime.num_handled += 1
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encode_vector(v, req.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


@post("/score", status_code=200, opt=body_of(ScoreRequest))
async def score(request: Request, state: State) -> dict:
    """vLLM's score API for embedding models: the cosine of each pair's embeddings; one
    `text_1` pairs with every `text_2`, or the lists pair up in order."""
    req = decode_body(await request.body(), ScoreRequest)
    engine: EngineClient = state.engine
    model = await check_model(state, req.model)
    limit = state.settings.max_embedding_inputs
    firsts, seconds = inputs_of(req.text_1, limit, "text_1"), inputs_of(req.text_2, limit,
                                                                        "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad_request(f"`text_1` ({len(firsts)}) and `text_2` ({len(seconds)}) must be "
                          "as long, or `text_1` one text", param="text_2")
    vectors, num_tokens = await embed(engine, model, firsts + seconds,
                                      req.truncate_prompt_tokens)
    unit = finish_vectors(vectors, normalize=True, dimensions=None)
    half = len(firsts)
    scores = (unit[:half] * unit[half:]).sum(axis=1)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model,
            "created": int(time.time()),
            "data": [{"index": i, "object": "score", "score": float(s)}
                     for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


EMBEDDING_ROUTES = [embeddings, score]

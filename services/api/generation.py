# Over 300 lines: one class whose collecting and streaming (plain or with tool calls) share
# its choices' state; the wire formats live in openai_responses.py and tool_calls.py.
"""One HTTP generation request in flight: its prompts x n completions, merged into choices.

A completion request may carry several prompts; each becomes its own pipeline request (with
n completions), and all of them deliver their deltas to one queue. Choice `p * n + i` is
completion i of prompt p, as in the OpenAI API.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from llmbus.bus.messages import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TextDelta,
    TextLogprob,
)
from llmbus.services.api import openai_responses as fmt
from llmbus.services.api.constraints import ToolUse
from llmbus.services.api.engine_client_bus import EngineClient
from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.metrics import ApiMetrics
from llmbus.services.api.reasoning import ReasoningSplitter
from llmbus.services.tool_calls import Call, parse_calls

log = structlog.get_logger()
_tracer = trace.get_tracer("llmbus.api")
CLIENT_GONE = "the client went away"


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    finish_reason: int = FinishReason.NONE
    num_tokens: int = 0
    text_offset: int = 0  # characters sent so far (completions' logprobs text_offset)
    last_delta_at: float | None = None
    # Streaming with tools: text held back while it may be calls (None: not decided yet).
    held: list[str] = field(default_factory=list)
    held_logprobs: list[TextLogprob] = field(default_factory=list)
    holding: bool | None = None
    # A thinking model's chat: its text split into reasoning and content as it streams.
    splitter: ReasoningSplitter | None = None


@dataclass
class Generation:
    engine: EngineClient
    id: str
    model: str
    chat: bool
    n: int
    with_logprobs: bool
    include_usage: bool
    echo_texts: list[str]  # per prompt; empty strings unless `echo`
    request_ids: list[str] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: int = field(default_factory=lambda: int(time.time()))
    num_prompt_tokens: int = 0
    choices: list[Choice] = field(default_factory=list)
    _prompt_of: dict[str, int] = field(default_factory=dict)
    _cached_of: dict[str, int] = field(default_factory=dict)  # prompt tokens the cache held
    metrics: ApiMetrics | None = None
    span: Span | None = None  # the request's root span: one trace across every service
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    queue_seconds: float = 0.0
    _itls: list[float] = field(default_factory=list)
    tools: ToolUse | None = None  # chat requests that may call functions
    reasoning: bool = False  # split the output at the think tags (the tokenizer decides)
    reasoning_open: bool = False  # ... the prompt opened the think block

    def _calls(self, choice: Choice, text: str) -> list[Call] | None:
        """The function calls a finished choice made, if it made calls."""
        if self.tools is None or choice.finish_reason != FinishReason.STOP:
            return None
        return parse_calls(text, set(self.tools.names))

    @classmethod
    async def start(cls, engine: EngineClient, *, chat: bool, model: str,
                    params: SamplingParams, n: int, sources: list[dict[str, Any]],
                    include_usage: bool, echo_texts: list[str] | None = None,
                    metrics: ApiMetrics | None = None,
                    tools: ToolUse | None = None) -> Generation:
        """Admit every prompt into the pipeline; if one is refused, abort the others."""
        prefix = "chatcmpl" if chat else "cmpl"
        gen = cls(engine, f"{prefix}-{uuid.uuid4().hex}", model, chat, n,
                  params.logprobs is not None, include_usage,
                  echo_texts or [""] * len(sources), metrics=metrics, tools=tools)
        gen.choices = [Choice() for _ in range(len(sources) * n)]
        gen.span = _tracer.start_span(
            "chat" if chat else "text_completion", kind=SpanKind.SERVER, attributes={
                "gen_ai.operation.name": "chat" if chat else "text_completion",
                "gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p, "gen_ai.request.choice.count": n,
                "llmbus.request_id": gen.id})
        token = otel_context.attach(trace.set_span_in_context(gen.span))
        try:
            with structlog.contextvars.bound_contextvars(request_id=gen.id):
                for p, source in enumerate(sources):
                    request_id = gen.id if len(sources) == 1 else f"{gen.id}-{p}"
                    gen._prompt_of[request_id] = p
                    gen.request_ids.append(request_id)
                    admission = await engine.submit(GenerateRequest(
                        request_id=request_id, reply_subject=engine.reply_subject, model=model,
                        params=params, n=n, **source), gen.queue)
                    gen.num_prompt_tokens += admission.num_prompt_tokens
                    gen.reasoning = chat and admission.reasoning
                    gen.reasoning_open = admission.reasoning_open
                for choice in gen.choices if gen.reasoning else []:
                    choice.splitter = ReasoningSplitter(gen.reasoning_open)
                log.info("request admitted", num_prompt_tokens=gen.num_prompt_tokens,
                         num_choices=len(gen.choices))
            if metrics is not None:
                span_context = gen.span.get_span_context()
                metrics.recent.started(
                    gen.id, time.time() - (time.monotonic() - gen.started_at),
                    gen.num_prompt_tokens,
                    format(span_context.trace_id, "032x") if span_context.is_valid else "")
        except BaseException as exc:
            await engine.release(gen.request_ids, finished=False)
            gen._end_span(error=str(exc), admitted=False)  # refused: not a request served
            raise
        finally:
            otel_context.detach(token)
        return gen

    def _end_span(self, error: str | None = None, admitted: bool = True) -> None:
        """Close the root span (once) and record the request's metrics (an admitted request
        that ended in an error counts as aborted)."""
        span, self.span = self.span, None
        if span is None:
            return
        reasons = [fmt.finish_reason_name(c.finish_reason) or "error" for c in self.choices]
        num_output = sum(c.num_tokens for c in self.choices)
        span.set_attributes({
            "gen_ai.usage.input_tokens": self.num_prompt_tokens,
            "gen_ai.usage.output_tokens": num_output,
            "gen_ai.response.finish_reasons": reasons, "gen_ai.response.id": self.id})
        ttft = None if self.first_token_at is None else self.first_token_at - self.started_at
        if ttft is not None:
            span.set_attribute("llmbus.time_to_first_token_s", ttft)
        if self.metrics is not None and admitted:
            self.metrics.count_model(self.model, self.num_prompt_tokens, num_output)
            self.metrics.recent.ended(
                self.id, status="finished" if error is None
                else "aborted" if error == CLIENT_GONE else "error",
                finish_reason=",".join(sorted(set(reasons))) if error is None else "",
                num_output_tokens=num_output,
                ttft_seconds=ttft, seconds=time.monotonic() - self.started_at)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
            if self.metrics is not None and admitted:  # cut short: client gone, pipeline error
                self.metrics.count_finished(
                    [fmt.finish_reason_name(c.finish_reason) or "abort" for c in self.choices])
        elif self.metrics is not None:
            self.metrics.observe_request(
                ttft=ttft, itls=self._itls, e2e=time.monotonic() - self.started_at,
                queue=self.queue_seconds, num_prompt_tokens=self.num_prompt_tokens,
                num_output_tokens=num_output, finish_reasons=reasons)
        span.end()

    def _apply(self, delta: TextDelta) -> tuple[int, Choice]:
        index = self._prompt_of.get(delta.request_id, 0) * self.n + delta.index
        choice = self.choices[index]
        now = time.monotonic()
        if delta.num_new_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                if self.span is not None:
                    self.span.add_event("first_token")
            # One latency per token: a delta of n tokens (drafts, several decode steps) spreads
            # its gap over them; tokens that came with the first share its arrival.
            n = delta.num_new_tokens
            if choice.last_delta_at is not None:
                self._itls.extend([(now - choice.last_delta_at) / n] * n)
            elif n > 1:
                self._itls.extend([0.0] * (n - 1))
            choice.last_delta_at = now
        self.queue_seconds = max(self.queue_seconds, delta.queue_seconds)
        if delta.num_cached_tokens:
            self._cached_of[delta.request_id] = delta.num_cached_tokens
        choice.text.append(delta.text)
        choice.logprobs.extend(delta.logprobs)
        choice.num_tokens = max(choice.num_tokens, delta.num_output_tokens)
        if delta.finish_reason != FinishReason.NONE:
            choice.finish_reason = delta.finish_reason
        return index, choice

    def usage(self) -> dict:
        return fmt.usage(self.num_prompt_tokens, sum(c.num_tokens for c in self.choices),
                         sum(self._cached_of.values()))

    async def collect(self) -> dict:
        """Wait for every choice; the whole non-streamed response body."""
        finished = False
        error: str | None = CLIENT_GONE
        try:
            async for delta in self.engine.deltas(self.queue, len(self.choices)):
                if delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    error = f"generation failed: {delta.error or 'aborted'}"
                    raise OpenAIError(500, error)
                self._apply(delta)
            finished, error = True, None
        finally:
            await self.engine.release(self.request_ids, finished)
            self._end_span(error)
        return {"id": self.id, "object": fmt.completion_object(self.chat, stream=False),
                "created": self.created, "model": self.model,
                "choices": [fmt.collected_choice(self, i, c) for i, c in enumerate(self.choices)],
                "usage": self.usage()}

    async def stream(self) -> AsyncIterator[tuple[None, str]]:
        """SSE events (unnamed) of JSON chunks, then `[DONE]`; a client that goes away
        cancels this and the requests are aborted."""
        async with aclosing(self.chunks()) as chunks:
            async for chunk in chunks:
                yield None, _json(chunk)
        yield None, "[DONE]"

    async def chunks(self) -> AsyncGenerator[dict, None]:
        """The chat (or text) completion chunks as they come, then the usage chunk if asked
        for; a failure ends them with an `{"error": ...}` chunk. The other API dialects
        (Responses, Messages) translate these, so every dialect streams through one path."""
        finished = False
        error: str | None = CLIENT_GONE
        stream_span = _tracer.start_span("sse_stream", context=trace.set_span_in_context(
            self.span)) if self.span is not None else None
        try:
            for index in range(len(self.choices)):
                if self.chat:
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None, None)
                elif self.echo_texts[index // self.n]:
                    yield self._chunk(index, self.echo_texts[index // self.n], None, None)
            async for delta in self.engine.deltas(self.queue, len(self.choices)):
                if delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    error = f"generation failed: {delta.error or 'aborted'}"
                    yield {"error": {"message": error, "type": "server_error", "param": None,
                                     "code": None}}
                    break  # not `finished`: the rest of the request is aborted everywhere
                for chunk in self._delta_chunks(delta):
                    yield chunk
            else:
                finished, error = True, None
                if self.include_usage:
                    yield {"id": self.id, "object": fmt.completion_object(self.chat, True),
                           "created": self.created, "model": self.model, "choices": [],
                           "usage": self.usage()}
        finally:
            await self.engine.release(self.request_ids, finished)
            if stream_span is not None:
                stream_span.end()
            self._end_span(error)

    def _delta_chunks(self, delta: TextDelta) -> list[dict]:
        """The SSE chunks one delta makes: its reasoning and its content (held while it may
        be function calls)."""
        index, choice = self._apply(delta)
        reason = fmt.finish_reason_name(delta.finish_reason)
        reasoning, text = self._split(choice, delta.text, reason)
        if self.tools is not None:
            chunks = ([self._chunk(index, {"reasoning_content": reasoning}, None, None)]
                      if reasoning else [])
            return chunks + self._tool_chunks(index, choice, text, delta.logprobs, reason)
        if reasoning:
            body = {"reasoning_content": reasoning} | ({"content": text} if text else {})
            return [self._chunk(index, body, reason, delta.logprobs, choice)]
        if text or delta.logprobs or reason:
            return [self._chunk(index, text, reason, delta.logprobs, choice)]
        return []

    @staticmethod
    def _split(choice: Choice, text: str, reason: str | None) -> tuple[str, str]:
        """A delta's text as (reasoning, content) to send now; ("", text) when not split."""
        if choice.splitter is None:
            return "", text
        reasoning, content = choice.splitter.feed(text)
        if reason:  # the choice ended: what was held back goes too
            more_reasoning, more_content = choice.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _tool_chunks(self, index: int, choice: Choice, text: str,
                     logprobs: list[TextLogprob], reason: str | None) -> list[dict]:
        """Stream a choice that may call functions: text that opens like calls (`[`, `{` or
        `<tool_call>`) is held to the end, then sent as tool-call deltas if it parses as calls
        (one delta per call, whole, which the OpenAI SDK accumulates as it would pieces);
        other text streams as content, with its logprobs."""
        if choice.holding is False:
            if text or logprobs or reason:
                return [self._chunk(index, text, reason, logprobs, choice)]
            return []
        choice.held.append(text)
        choice.held_logprobs.extend(logprobs)
        if choice.holding is None:
            start = "".join(choice.held).lstrip()
            choice.holding = _opens_calls(start) if start else None
        if not reason and choice.holding is not False:
            return []
        # Held since the answer began (its start decided the holding): the whole answer.
        text, logprobs = "".join(choice.held), choice.held_logprobs
        choice.held, choice.held_logprobs = [], []
        calls = self._calls(choice, text) if reason else None
        if calls:
            return [self._chunk(index, {"tool_calls": fmt.tool_calls(calls, stream=True)},
                                "tool_calls", logprobs)]
        if text or logprobs or reason:
            return [self._chunk(index, text, reason, logprobs, choice)]
        return []

    def _chunk(self, index: int, content: Any, reason: str | None,
               logprobs: list[TextLogprob] | None, choice: Choice | None = None) -> dict:
        if self.chat:
            delta = content if isinstance(content, dict) else (
                {"content": content} if content else {})
            body: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                    "finish_reason": reason}
            if self.with_logprobs and logprobs:
                body["logprobs"] = fmt.chat_logprobs(logprobs)
        else:
            body = {"index": index, "text": content, "logprobs": None, "finish_reason": reason}
            if self.with_logprobs and logprobs and choice is not None:
                offset = len(self.echo_texts[index // self.n]) + choice.text_offset
                body["logprobs"] = fmt.completion_logprobs(logprobs, offset)
        if choice is not None:
            choice.text_offset += len(content) if isinstance(content, str) else 0
        return {"id": self.id, "object": fmt.completion_object(self.chat, stream=True),
                "created": self.created, "model": self.model, "choices": [body]}


def _opens_calls(start: str) -> bool | None:
    """Whether text (stripped, not empty) opens like function calls; None while it may yet."""
    if start[0] in "[{":
        return True
    if start.startswith("<tool_call>"):
        return True
    return None if "<tool_call>".startswith(start) else False


def _json(data: Any) -> str:
    return msgspec.json.encode(data).decode()

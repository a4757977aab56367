"""One HTTP generation request in flight: its prompts x n completions, merged into choices.

A completion request may carry several prompts; each becomes its own pipeline request (with
n completions), and all of them deliver their deltas to one queue. Choice `p * n + i` is
completion i of prompt p, as in the OpenAI API.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bus.messages import FinishReason, GenerateRequest, SamplingParams, TextDelta, TextLogprob
from services.api import openai_responses as fmt
from services.api.engine_client import EngineClient
from services.api.errors import OpenAIError


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    finish_reason: int = FinishReason.NONE
    num_tokens: int = 0
    text_offset: int = 0  # characters sent so far (completions' logprobs text_offset)


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

    @classmethod
    async def start(cls, engine: EngineClient, *, chat: bool, model: str,
                    params: SamplingParams, n: int, sources: list[dict[str, Any]],
                    include_usage: bool, echo_texts: list[str] | None = None) -> Generation:
        """Admit every prompt into the pipeline; if one is refused, abort the others."""
        prefix = "chatcmpl" if chat else "cmpl"
        gen = cls(engine, f"{prefix}-{uuid.uuid4().hex}", model, chat, n,
                  params.logprobs is not None, include_usage,
                  echo_texts or [""] * len(sources))
        gen.choices = [Choice() for _ in range(len(sources) * n)]
        try:
            for p, source in enumerate(sources):
                request_id = gen.id if len(sources) == 1 else f"{gen.id}-{p}"
                gen._prompt_of[request_id] = p
                gen.request_ids.append(request_id)
                admission = await engine.submit(GenerateRequest(
                    request_id=request_id, reply_subject=engine.reply_subject, model=model,
                    params=params, n=n, **source), gen.queue)
                gen.num_prompt_tokens += admission.num_prompt_tokens
        except BaseException:
            await engine.release(gen.request_ids, finished=False)
            raise
        return gen

    def _apply(self, delta: TextDelta) -> tuple[int, Choice]:
        index = self._prompt_of.get(delta.request_id, 0) * self.n + delta.index
        choice = self.choices[index]
        choice.text.append(delta.text)
        choice.logprobs.extend(delta.logprobs)
        choice.num_tokens = max(choice.num_tokens, delta.num_output_tokens)
        if delta.finish_reason != FinishReason.NONE:
            choice.finish_reason = delta.finish_reason
        return index, choice

    def usage(self) -> dict:
        return fmt.usage(self.num_prompt_tokens, sum(c.num_tokens for c in self.choices))

    async def collect(self) -> dict:
        """Wait for every choice; the whole non-streamed response body."""
        finished = False
        try:
            async for delta in self.engine.deltas(self.queue, len(self.choices)):
                if delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    raise OpenAIError(500, f"generation failed: {delta.error or 'aborted'}")
                self._apply(delta)
            finished = True
        finally:
            await self.engine.release(self.request_ids, finished)
        choices = []
        for index, choice in enumerate(self.choices):
            echo = self.echo_texts[index // self.n]
            text = echo + "".join(choice.text)
            reason = fmt.finish_reason_name(choice.finish_reason)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": fmt.chat_logprobs(choice.logprobs)
                                if self.with_logprobs else None, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": fmt.completion_logprobs(
                    choice.logprobs, len(echo)) if self.with_logprobs else None,
                    "finish_reason": reason})
        return {"id": self.id, "object": fmt.completion_object(self.chat, stream=False),
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}

    async def stream(self) -> AsyncIterator[str]:
        """SSE data lines; a client that goes away cancels this and the requests are aborted."""
        finished = False
        try:
            for index in range(len(self.choices)):
                if self.chat:
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None, None)
                elif self.echo_texts[index // self.n]:
                    yield self._chunk(index, self.echo_texts[index // self.n], None, None)
            async for delta in self.engine.deltas(self.queue, len(self.choices)):
                if delta.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    yield _json({"error": {"message": "generation failed: "
                                           f"{delta.error or 'aborted'}", "type": "server_error",
                                           "param": None, "code": None}})
                    finished = True
                    break
                index, choice = self._apply(delta)
                reason = fmt.finish_reason_name(delta.finish_reason)
                if delta.text or delta.logprobs or reason:
                    yield self._chunk(index, delta.text, reason, delta.logprobs, choice)
            else:
                finished = True
                if self.include_usage:
                    yield _json({"id": self.id, "object": fmt.completion_object(self.chat, True),
                                 "created": self.created, "model": self.model, "choices": [],
                                 "usage": self.usage()})
            yield "[DONE]"
        finally:
            await self.engine.release(self.request_ids, finished)

    def _chunk(self, index: int, content: Any, reason: str | None,
               logprobs: list[TextLogprob] | None, choice: Choice | None = None) -> str:
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
        return _json({"id": self.id, "object": fmt.completion_object(self.chat, stream=True),
                      "created": self.created, "model": self.model, "choices": [body]})


def _json(data: Any) -> str:
    return msgspec.json.encode(data).decode()

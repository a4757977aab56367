"""The tokenizer's bus adapter: turn an api request into token ids and admit it into an engine.

Stateless, so every copy joins one queue group. The reply to the api is the engine's own
admission answer, so a request the engine cannot serve is refused before the client is told
anything else.
"""

from __future__ import annotations

import argparse
import time

import nats.errors
import structlog
from nats.aio.msg import Msg
from opentelemetry import trace

from llmbus.bus import subjects
from llmbus.bus.messages import (
    AbortRequest,
    Admission,
    CacheEvent,
    DecodeRequest,
    DecodeResult,
    EncodeRequest,
    EncodeResult,
    ErrorCode,
    GenerateRequest,
    Heartbeat,
    SubmitRequest,
)
from llmbus.bus.runtime import ServiceRuntime
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import resolve_model
from llmbus.services.tokenizer.chat_template import ChatTemplateError
from llmbus.services.tokenizer.router import Router
from llmbus.services.tokenizer.tokenization import REASONING_PARSERS, Prompt, Tokenization

log = structlog.get_logger()
_tracer = trace.get_tracer("llmbus.tokenizer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="path of a GGUF model (default: the pulled default model)")
    parser.add_argument("--routing", choices=("cache-aware", "random"), default="cache-aware",
                        help="how requests are spread over engines: to the engine caching "
                             "the longest prefix, balanced against load; or at random "
                             "(default: cache-aware)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="auto",
                        help="split a chat's output at <think>...</think> into "
                             "`reasoning_content` and `content`, as vLLM's reasoning parsers "
                             "do: 'think' always, 'auto' where the model's chat template "
                             "writes <think> (Qwen3, DeepSeek-R1 distills), 'none' never "
                             "(default: auto)")


ADMISSION_TIMEOUT = 3.0  # seconds an engine has to answer a submit before the next is tried
# Admissions handled at once by one copy: each mostly waits on an engine's answer (up to
# ADMISSION_TIMEOUT per engine tried), so one slow engine must not hold the requests for the
# others; bounded so that a burst waits in the subscription's queue instead of piling up tasks.
MAX_ADMISSIONS_IN_FLIGHT = 64


async def submit_to_an_engine(runtime: ServiceRuntime, router: Router, submit: SubmitRequest,
                              timeout: float = ADMISSION_TIMEOUT,
                              avoid_instance_id: str = "") -> Admission:
    """Route to the best engine; on a dead or silent one, try the next. Never hangs.

    An engine that did not answer in time may still admit the request later (a stalled
    process): it is told to withdraw it, so that it never runs on two engines; once every
    live engine was tried, the answer is "no engine is available" (a 503 to retry). A migrated
    request avoids the engine that failed it while another is alive, and is routed by its
    prompt and the output it resumes from (what an engine may have cached).
    """
    tried: set[str] = set()
    refused: Admission | None = None
    routed_ids = submit.prompt_token_ids + (submit.resumed[0].output_token_ids
                                            if submit.resumed else [])
    while True:
        now = runtime.bus_time()
        adapter = submit.params.adapter
        chosen = (router.choose(routed_ids, now, frozenset(tried | {avoid_instance_id}), adapter)
                  or router.choose(routed_ids, now, frozenset(tried), adapter))
        if chosen is None and tried:
            break  # each live engine tried: the one it was withdrawn from would refuse it
        subject = (subjects.engine_submit(chosen.engine_id) if chosen is not None
                   else subjects.ENGINE_SUBMIT)  # no heartbeat yet: any engine
        try:
            admission = await runtime.request(subject, submit, Admission, timeout=timeout)
            if admission.error_code != ErrorCode.OVERLOADED or chosen is None:
                return admission
            refused = admission  # this engine's queue is full: try the others
            tried.add(chosen.instance_id)
            continue
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            log.warning("engine did not admit the request", request_id=submit.request_id,
                        engine=chosen.engine_id if chosen else None, error=type(exc).__name__)
            if chosen is None:
                break
            if isinstance(exc, nats.errors.TimeoutError):
                await runtime.publish(subjects.engine_withdraw(chosen.engine_id),
                                      AbortRequest(submit.request_id,
                                                   up_to_attempt=submit.attempt))
            tried.add(chosen.instance_id)
    return refused or Admission(error_code=ErrorCode.OVERLOADED,
                                error_message="no engine is available; retry shortly")


class TokenizerService:
    """The tokenizer stage's handlers: prompts to token ids, routed to an engine."""

    def __init__(self, runtime: ServiceRuntime, tokenization: Tokenization,
                 router: Router) -> None:
        self.runtime, self.tokenization, self.router = runtime, tokenization, router

    async def subscribe(self) -> None:
        runtime, group = self.runtime, subjects.queue_group("tokenizer")

        async def pardon_engines() -> None:  # their silence was ours
            self.router.liveness.pardon(time.monotonic())

        runtime.on_reconnect(pardon_engines)
        await runtime.on_message(subjects.heartbeat("scheduler"), Heartbeat,
                                 self.on_engine_heartbeat)
        await runtime.on_message(subjects.ENGINE_CACHE_EVENTS, CacheEvent, self.on_cache_event)
        await runtime.on_request(subjects.TOKENIZER_GENERATE, GenerateRequest, self.on_generate,
                                 queue=group, concurrency=MAX_ADMISSIONS_IN_FLIGHT)
        await runtime.on_request(subjects.TOKENIZER_ENCODE, EncodeRequest, self.on_encode,
                                 queue=group)
        await runtime.on_request(subjects.TOKENIZER_DECODE, DecodeRequest, self.on_decode,
                                 queue=group)

    def _prompt(self, request: GenerateRequest) -> Prompt | Admission:
        """The prompt's token ids, or the refusal of a request that cannot be tokenized."""
        try:
            self.tokenization.check_token_ids(list(request.params.logit_bias),
                                              "logit_bias key")
        except ValueError as exc:
            return Admission(error_code=ErrorCode.INVALID_REQUEST, error_message=str(exc),
                             error_param="logit_bias")
        with _tracer.start_as_current_span("tokenize", attributes={
                "llmbus.request_id": request.request_id}) as span:
            try:
                prompt = self.tokenization.prompt(request)
            except (ValueError, ChatTemplateError) as exc:
                param = "messages" if request.messages else "prompt"
                return Admission(error_code=ErrorCode.INVALID_REQUEST,
                                 error_message=str(exc), error_param=param)
            span.set_attribute("gen_ai.usage.input_tokens", len(prompt.token_ids))
        if not prompt.token_ids:
            return Admission(error_code=ErrorCode.INVALID_REQUEST,
                             error_message="the prompt is empty after tokenization",
                             error_param="prompt")
        return prompt

    async def on_generate(self, request: GenerateRequest, _: Msg) -> Admission:
        self.runtime.num_handled += 1
        prompt = self._prompt(request)
        if isinstance(prompt, Admission):
            return prompt
        if request.params.structured is not None:  # a thinking model's answer, not its thought
            request.params.structured.after = prompt.constraint_after
        submit = SubmitRequest(request_id=request.request_id,
                               reply_subject=request.reply_subject,
                               prompt_token_ids=prompt.token_ids, params=request.params,
                               arrival_time=time.time(), n=request.n, attempt=request.attempt,
                               resumed=request.resumed,
                               avoid_detokenizer_ids=request.avoid_detokenizer_ids)
        admission = await submit_to_an_engine(self.runtime, self.router, submit,
                                              avoid_instance_id=request.avoid_instance_id)
        # the engine names the chat's field; a plain prompt's is `prompt`
        if admission.error_code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and request.messages:
            admission.error_param = admission.error_param or "messages"
        elif admission.error_param == "messages" and not request.messages:
            admission.error_param = "prompt"
        admission.reasoning, admission.reasoning_open = prompt.reasoning, prompt.reasoning_open
        return admission

    async def on_engine_heartbeat(self, heartbeat: Heartbeat, _: Msg) -> None:
        self.router.on_heartbeat(heartbeat, time.monotonic())
        for dead in self.router.forget_dead(self.runtime.bus_time()):
            log.warning("engine gone", engine=dead.engine_id, instance=dead.instance_id)

    async def on_cache_event(self, event: CacheEvent, _: Msg) -> None:
        self.router.on_cache_event(event.instance_id, event)

    async def on_encode(self, request: EncodeRequest, _: Msg) -> EncodeResult:
        try:
            return EncodeResult(token_ids=self.tokenization.prompt_token_ids(request))
        except (ValueError, ChatTemplateError) as exc:
            return EncodeResult(error_message=str(exc))

    async def on_decode(self, request: DecodeRequest, _: Msg) -> DecodeResult:
        try:
            self.tokenization.check_token_ids(request.token_ids)
        except ValueError as exc:
            return DecodeResult(error_message=str(exc))
        return DecodeResult(text=self.tokenization.tokenizer.decode(request.token_ids))


async def main(args: argparse.Namespace) -> None:
    tokenization = Tokenization(GGUFTokenizer.from_gguf(resolve_model(args.model)),
                                reasoning_parser=args.reasoning_parser)
    async with ServiceRuntime("tokenizer", args.nats_url, args.instance_id) as runtime:
        await TokenizerService(runtime, tokenization, Router(policy=args.routing)).subscribe()
        log.info("vocabulary loaded", vocab_size=tokenization.tokenizer.vocab_size)
        await runtime.serve()

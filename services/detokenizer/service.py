"""The detokenizer's bus adapter: token ids in, text deltas out, one message per api per step.

Per-request decode state lives here (the incremental window and held-back stop-string text),
so this stage is not a plain queue group: with a queue group, two steps of one request could be
decoded by different copies. Instead each copy announces itself by heartbeat and the scheduler
sends each completion's tokens to one copy's own subject (services/scheduler/
detokenizer_routing.py says how, and what happens when a copy dies).

When a stop string ends a request, the scheduler is told at once (an abort) so its KV blocks
are freed; tokens of that request still in flight are dropped. Tokens of a completion this copy
never got the start of are reported to their engine, which ends it with an error.
"""

from __future__ import annotations

import argparse
import time

import structlog
from nats.aio.msg import Msg
from opentelemetry import trace

from llmbus.bus import subjects
from llmbus.bus.messages import AbortRequest, DeltaBatch, TokenBatch, UnknownCompletion
from llmbus.bus.runtime import ServiceRuntime
from llmbus.bus.tracing import context_from_traceparent
from llmbus.services.detokenizer.detokenization import Detokenization, EndedCompletion
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import resolve_model

log = structlog.get_logger()
_tracer = trace.get_tracer("llmbus.detokenizer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="path of a GGUF model (default: the pulled default model)")


def _record_span(ended: EndedCompletion) -> None:
    """One span per completion, from its first tokens to its end, in the request's trace."""
    if not ended.traceparent:
        return
    _tracer.start_span("detokenize", context=context_from_traceparent(ended.traceparent),
                       start_time=ended.started_ns, attributes={
                           "llmbus.request_id": ended.key[0], "llmbus.choice_index": ended.key[1],
                           "gen_ai.usage.output_tokens": ended.num_tokens,
                           "gen_ai.response.finish_reasons": [ended.reason.name.lower()]},
                       ).end(end_time=max(ended.ended_ns, ended.started_ns))


async def subscribe(runtime: ServiceRuntime, detokenization: Detokenization) -> None:
    """The detokenizer's handlers: token batches in, text deltas (and stop-string aborts) out."""

    async def on_tokens(batch: TokenBatch, _: Msg) -> None:
        runtime.num_handled += 1
        processed = detokenization.process(batch, time.time_ns())
        for ended in processed.ended:
            _record_span(ended)
        for (request_id, index), attempt in processed.newly_stopped:  # free its blocks now
            await runtime.publish(subjects.SCHEDULER_ABORT,
                                  AbortRequest(request_id, index, up_to_attempt=attempt))
        for reply_subject, deltas in processed.deltas.items():
            await runtime.publish(reply_subject, DeltaBatch(items=deltas))
        for request_id, index in processed.unknown:  # its engine ends it with an error
            log.warning("tokens of an unknown completion", request_id=request_id, index=index)
            await runtime.publish(subjects.engine_unknown_completion(batch.engine_id),
                                  UnknownCompletion(request_id, index, runtime.instance_id))

    async def on_reconnect() -> None:
        """Tokens sent to this copy while it was off the bus are lost: each completion it holds
        ends with a resumable error, and its api resumes it from the text it has."""
        error = f"detokenizer {runtime.instance_id} lost its bus connection"
        for reply_subject, deltas in detokenization.end_all(error).items():
            await runtime.publish(reply_subject, DeltaBatch(items=deltas))

    runtime.on_reconnect(on_reconnect)
    # Our own subject: the scheduler sends each completion to one copy (sticky decode state).
    await runtime.on_message(subjects.detokenizer_tokens(runtime.instance_id), TokenBatch,
                             on_tokens)
    await runtime.on_message(subjects.DETOKENIZER_TOKENS, TokenBatch, on_tokens,
                             queue=subjects.queue_group("detokenizer"))


async def main(args: argparse.Namespace) -> None:
    tokenizer = GGUFTokenizer.from_gguf(resolve_model(args.model))
    async with ServiceRuntime("detokenizer", args.nats_url, args.instance_id) as runtime:
        await subscribe(runtime, Detokenization(tokenizer, runtime.instance_id))
        await runtime.serve()

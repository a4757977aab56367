"""A finished request's time in the engine, as spans of its trace.

The engine loop serves many requests per step, so spans are not opened and closed around
code: the scheduler stamps each request (first scheduled, each prefill chunk, first token,
end) and, when it ends, these spans are recorded with those times, under the request's own
trace context:

    engine.queue    arrival -> first step
    engine.prefill  first step -> first token, with one child span per prefill chunk, and
                    one per try of a prefill engine (engine.remote_prefill, disaggregation)
    engine.decode   first token -> end, as one span (not one per token), with the draft
                    tokens speculative decoding verified and accepted for the request
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from llmbus.bus.tracing import context_from_traceparent
from llmbus.services.scheduler.request import Request

_tracer = trace.get_tracer("llmbus.scheduler")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def record_request_spans(request: Request, now: float) -> None:
    stamps = request.trace
    if not stamps.traceparent:
        return
    parent = context_from_traceparent(stamps.traceparent)
    attributes: dict[str, AttributeValue] = {
        "llmbus.request_id": request.request_id, "llmbus.choice_index": request.index,
        "llmbus.num_preemptions": stamps.num_preemptions}
    end = stamps.finish_time or now
    scheduled = stamps.first_scheduled_time
    queue_end = scheduled if scheduled is not None else end
    _tracer.start_span("engine.queue", context=parent, start_time=_ns(request.trace.arrival_time),
                       attributes=attributes).end(end_time=_ns(max(queue_end,
                                                                   request.trace.arrival_time)))
    if scheduled is None:
        return
    first_token = stamps.first_token_time or end
    prefill = _tracer.start_span("engine.prefill", context=parent, start_time=_ns(scheduled),
                                 attributes={**attributes,
                                             "gen_ai.usage.input_tokens":
                                             request.num_prompt_tokens})
    chunks = stamps.prefill_chunks
    prefill_context = trace.set_span_in_context(prefill)
    for i, (started, num_tokens) in enumerate(chunks):
        ended = chunks[i + 1][0] if i + 1 < len(chunks) else first_token
        _tracer.start_span("engine.prefill_chunk", context=prefill_context,
                           start_time=_ns(started),
                           attributes={"llmbus.num_tokens": num_tokens}).end(
            end_time=_ns(max(ended, started)))
    for engine_id, started, ended, num_bytes in request.remote.tries:
        _tracer.start_span("engine.remote_prefill", context=prefill_context,
                           start_time=_ns(started), attributes={
                               "llmbus.prefill_engine": engine_id,
                               "llmbus.kv_bytes": num_bytes,
                               "llmbus.given_up": not num_bytes}).end(
            end_time=_ns(max(ended, started)))
    prefill.end(end_time=_ns(max(first_token, scheduled)))
    if stamps.first_token_time is not None:
        decode = _tracer.start_span(
            "engine.decode", context=parent, start_time=_ns(first_token), attributes={
                **attributes, "gen_ai.usage.output_tokens": len(request.output_token_ids),
                "gen_ai.response.finish_reasons": [request.finish_reason.name.lower()],
                "llmbus.spec.num_draft_tokens": request.spec.num_draft_tokens,
                "llmbus.spec.num_accepted_tokens": request.spec.num_accepted_tokens})
        decode.end(end_time=_ns(max(end, first_token)))

"""The detokenizer's bus adapter: token ids in, text deltas out, one message per api per step.

Per-request decode state lives here (the incremental window and held-back stop-string text),
so this stage is not a plain queue group: with a queue group, two steps of one request could be
decoded by different copies. Instead each copy announces itself by heartbeat and the scheduler
sends each completion's tokens to one copy's own subject (services/scheduler/
detokenizer_routing.py says how, and what happens when a copy dies).

When a stop string ends a request, the scheduler is told at once (an abort) so its KV blocks
are freed; tokens of that request still in flight are dropped.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import structlog
from nats.aio.msg import Msg
from opentelemetry import trace

from bus import subjects
from bus.messages import (
    AbortRequest,
    DeltaBatch,
    FinishReason,
    TextDelta,
    TextLogprob,
    TokenBatch,
    TokenLogprobs,
)
from bus.runtime import ServiceRuntime
from bus.tracing import context_from_traceparent
from services.detokenizer.incremental import IncrementalDetokenizer
from services.gguf_tokenizer import GGUFTokenizer, byte_alphabet
from services.model_files import resolve_model

log = structlog.get_logger()
_tracer = trace.get_tracer("llmbus.detokenizer")

# Requests ended by a stop string are remembered until the scheduler confirms their end.
_MAX_STOPPED_REMEMBERED = 10_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="path of a GGUF model (default: the pulled default model)")


class TokenTexts:
    """Text and exact bytes of single tokens, for logprobs (cached: the vocabulary is fixed)."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_of = {char: byte for byte, char in byte_alphabet().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            [spelling] = self.tokenizer.convert_ids_to_tokens([token_id])
            if token_id in self.tokenizer.special_token_ids:
                raw = spelling.encode()
            else:  # byte-level BPE: each character stands for one byte
                raw = bytes(self._byte_of.get(c, 0x3F) for c in spelling)
            found = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return found

    def logprobs(self, entries: list[TokenLogprobs], token_ids: list[int]) -> list[TextLogprob]:
        out = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            token, raw = self(token_id)
            tops = [self(t) for t in entry.top_token_ids]
            out.append(TextLogprob(
                token=token, logprob=entry.logprob, top_tokens=[t for t, _ in tops],
                top_logprobs=list(entry.top_logprobs), token_bytes=raw,
                top_token_bytes=[b for _, b in tops]))
        return out


class Detokenization:
    """All in-flight requests' decode states; pure (no bus), driven by TokenBatches."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        # Keyed by (request id, completion index): n > 1 completions decode separately.
        self.states: dict[tuple[str, int], IncrementalDetokenizer] = {}
        # When each completion was first seen, and its trace context: for its span.
        self.started: dict[tuple[str, int], tuple[int, str]] = {}
        self.stopped: dict[tuple[str, int], None] = {}  # insertion-ordered set

    def process(self, batch: TokenBatch, now_ns: int = 0,
                ) -> tuple[dict[str, list[TextDelta]], list[tuple[str, int]]]:
        """Deltas grouped by api reply subject, and completions a stop string just ended.

        `now_ns` only stamps the detokenize span of each completion.
        """
        out: dict[str, list[TextDelta]] = defaultdict(list)
        newly_stopped: list[tuple[str, int]] = []
        for item in batch.items:
            key = (item.request_id, item.index)
            if key in self.stopped:
                if item.finish_reason != FinishReason.NONE:
                    del self.stopped[key]
                continue
            state = self.states.get(key)
            if state is None:
                state = IncrementalDetokenizer(
                    self.tokenizer.decode, stop=item.stop,
                    include_stop_str_in_output=item.include_stop_str_in_output)
                self.states[key] = state
                self.started[key] = (now_ns, item.traceparent)
                if item.replay_token_ids:  # taken over from a copy that died: its text went
                    # out already; decoding its tokens again restores what it held back for a
                    # stop string (or, had they ended it, keeps the completion stopped)
                    state.step(item.replay_token_ids)
            delta = state.step(item.new_token_ids)
            text, reason = delta.text, FinishReason(item.finish_reason)
            if delta.stopped:
                reason = FinishReason.STOP
                if item.finish_reason == FinishReason.NONE:
                    newly_stopped.append(key)
                    self._remember_stopped(key)
            elif reason != FinishReason.NONE:
                flushed = state.finish()
                text += flushed.text
                if flushed.stopped:
                    reason = FinishReason.STOP
            if reason != FinishReason.NONE:
                del self.states[key]
                started_ns, traceparent = self.started.pop(key)
                _record_span(key, started_ns, now_ns, traceparent, state.num_tokens, reason)
            out[item.reply_subject].append(TextDelta(
                request_id=item.request_id, text=text, num_new_tokens=len(item.new_token_ids),
                finish_reason=reason, num_prompt_tokens=item.num_prompt_tokens,
                num_output_tokens=state.num_tokens, error=item.error, step_id=item.step_id,
                index=item.index, logprobs=self.token_texts.logprobs(
                    item.logprobs, item.new_token_ids) if item.logprobs else [],
                queue_seconds=item.queue_seconds))
        return out, newly_stopped

    def _remember_stopped(self, key: tuple[str, int]) -> None:
        self.stopped[key] = None
        while len(self.stopped) > _MAX_STOPPED_REMEMBERED:
            del self.stopped[next(iter(self.stopped))]


def _record_span(key: tuple[str, int], started_ns: int, ended_ns: int, traceparent: str,
                 num_tokens: int, reason: FinishReason) -> None:
    """One span per completion, from its first tokens to its end, in the request's trace."""
    if not traceparent:
        return
    _tracer.start_span("detokenize", context=context_from_traceparent(traceparent),
                       start_time=started_ns, attributes={
                           "llmbus.request_id": key[0], "llmbus.choice_index": key[1],
                           "gen_ai.usage.output_tokens": num_tokens,
                           "gen_ai.response.finish_reasons": [reason.name.lower()]},
                       ).end(end_time=max(ended_ns, started_ns))


async def main(args: argparse.Namespace) -> None:
    runtime = ServiceRuntime("detokenizer", args.nats_url, args.instance_id)
    await runtime.connect()
    runtime.install_signal_handlers()
    detokenization = Detokenization(GGUFTokenizer.from_gguf(resolve_model(args.model)))

    async def on_tokens(batch: TokenBatch, _: Msg) -> None:
        runtime.num_handled += 1
        by_api, newly_stopped = detokenization.process(batch, time.time_ns())
        for request_id, index in newly_stopped:  # free its KV blocks now
            await runtime.publish(subjects.SCHEDULER_ABORT, AbortRequest(request_id, index))
        for reply_subject, deltas in by_api.items():
            await runtime.publish(reply_subject, DeltaBatch(items=deltas))

    # Our own subject: the scheduler sends each completion to one copy (sticky decode state).
    await runtime.on_message(subjects.detokenizer_tokens(runtime.instance_id), TokenBatch,
                             on_tokens)
    await runtime.on_message(subjects.DETOKENIZER_TOKENS, TokenBatch, on_tokens,
                             queue=subjects.queue_group("detokenizer"))
    runtime.ready = True
    runtime.start_heartbeat()
    log.info("detokenizer ready")
    try:
        await runtime.stop_event.wait()
    finally:
        await runtime.close()

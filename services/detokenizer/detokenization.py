"""The detokenizer stage's pure core: every in-flight completion's incremental decode state,
driven by the scheduler's TokenBatches, giving text deltas per api copy. No bus, no spans (the
adapter, service.py, records a span per ended completion from what `process` returns)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from llmbus.bus.messages import FinishReason, TextDelta, TextLogprob, TokenBatch, TokenLogprobs
from llmbus.services.detokenizer.incremental import IncrementalDetokenizer
from llmbus.services.gguf_tokenizer import GGUFTokenizer, byte_alphabet

# Requests ended by a stop string are remembered until the scheduler confirms their end.
_MAX_STOPPED_REMEMBERED = 10_000


@dataclass(frozen=True)
class EndedCompletion:
    key: tuple[str, int]  # (request id, completion index)
    started_ns: int
    ended_ns: int
    traceparent: str
    num_tokens: int
    reason: FinishReason


@dataclass(frozen=True)
class Processed:
    """What one TokenBatch gives: deltas by api reply subject, completions a stop string just
    ended (the scheduler is told, to free their blocks), and every completion that ended."""

    deltas: dict[str, list[TextDelta]]
    newly_stopped: list[tuple[str, int]]
    ended: list[EndedCompletion]


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

    def process(self, batch: TokenBatch, now_ns: int = 0) -> Processed:
        """Deltas grouped by api reply subject, completions a stop string just ended, and
        every completion that ended (for the adapter's spans; `now_ns` stamps them)."""
        out: dict[str, list[TextDelta]] = defaultdict(list)
        newly_stopped: list[tuple[str, int]] = []
        ended: list[EndedCompletion] = []
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
                ended.append(EndedCompletion(key, started_ns, now_ns, traceparent,
                                             state.num_tokens, reason))
            out[item.reply_subject].append(TextDelta(
                request_id=item.request_id, text=text, num_new_tokens=len(item.new_token_ids),
                finish_reason=reason, num_prompt_tokens=item.num_prompt_tokens,
                num_output_tokens=state.num_tokens, error=item.error, step_id=item.step_id,
                index=item.index, logprobs=self.token_texts.logprobs(
                    item.logprobs, item.new_token_ids) if item.logprobs else [],
                queue_seconds=item.queue_seconds))
        return Processed(out, newly_stopped, ended)

    def _remember_stopped(self, key: tuple[str, int]) -> None:
        self.stopped[key] = None
        while len(self.stopped) > _MAX_STOPPED_REMEMBERED:
            del self.stopped[next(iter(self.stopped))]

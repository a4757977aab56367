"""The detokenizer stage's pure core: every in-flight completion's incremental decode state,
driven by the scheduler's TokenBatches, giving text deltas per api copy. No bus, no spans (the
adapter, service.py, records a span per ended completion from what `process` returns)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from llmbus.bus.messages import (
    CompletionStart,
    FinishReason,
    RequestTokens,
    TextDelta,
    TextLogprob,
    TokenBatch,
    TokenLogprobs,
)
from llmbus.services.detokenizer.incremental import IncrementalDetokenizer
from llmbus.services.gguf_tokenizer import GGUFTokenizer, byte_alphabet

# Completions ended by a stop string are remembered until the scheduler confirms their end;
# unknown ones (their start was lost) until their start comes.
_MAX_REMEMBERED = 10_000

Key = tuple[str, int]  # (request id, completion index)


@dataclass(frozen=True)
class EndedCompletion:
    key: Key
    started_ns: int
    ended_ns: int
    traceparent: str
    num_tokens: int
    reason: FinishReason


@dataclass(frozen=True)
class Processed:
    """What one TokenBatch gives: deltas by api reply subject, completions a stop string just
    ended (the scheduler is told, to free their blocks), every completion that ended, and
    completions this copy cannot decode (it never got their start; the scheduler is told)."""

    deltas: dict[str, list[TextDelta]]
    newly_stopped: list[tuple[Key, int]]  # with the attempt a stop string ended
    ended: list[EndedCompletion]
    unknown: list[Key] = field(default_factory=list)


@dataclass
class _Completion:
    decoder: IncrementalDetokenizer
    start: CompletionStart  # its constants
    started_ns: int  # when this copy took it up, for its span
    attempt: int = 0  # tokens of an older attempt are stale: dropped


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
    """All in-flight completions' decode states; pure (no bus), driven by TokenBatches."""

    def __init__(self, tokenizer: GGUFTokenizer, instance_id: str = "") -> None:
        self.tokenizer = tokenizer
        self.instance_id = instance_id  # named in every delta (TextDelta.detokenizer_id)
        self.token_texts = TokenTexts(tokenizer)
        # n > 1 completions decode separately.
        self.completions: dict[Key, _Completion] = {}
        # Ended here (a stop string, lost tokens) before their engine said so: their attempt,
        # whose further tokens are dropped. Insertion-ordered, like `reported`.
        self.stopped: dict[Key, int] = {}
        self.reported: dict[Key, None] = {}

    def process(self, batch: TokenBatch, now_ns: int = 0) -> Processed:
        """Deltas grouped by api reply subject, completions a stop string just ended, every
        completion that ended (for the adapter's spans; `now_ns` stamps them), and the unknown
        completions to report.

        An item with a `start` sets its completion up afresh; an item of a completion this copy
        holds nothing of, without a start, gives no text (it could only be wrong: its start
        and first tokens were lost): the completion is reported once, and the scheduler ends
        it with an error, sent with its start. Items of an attempt older than the one held are
        dropped. An item that does not follow the tokens held (a batch between was lost) ends
        the completion with a resumable error: its owner resumes it from what it received."""
        out: dict[str, list[TextDelta]] = defaultdict(list)
        processed = Processed(out, [], [])
        for item in batch.items:
            key = (item.request_id, item.index)
            stopped_attempt = self.stopped.get(key)
            if stopped_attempt is not None:
                if item.attempt <= stopped_attempt:
                    if item.finish_reason != FinishReason.NONE and item.attempt == stopped_attempt:
                        del self.stopped[key]
                    continue
                del self.stopped[key]  # a later attempt: it starts afresh
            completion = self.completions.get(key)
            if completion is not None and item.attempt < completion.attempt:
                continue
            if item.start is not None:
                completion = self._start(key, item.start, item.attempt, now_ns)
            elif completion is not None and item.attempt > completion.attempt:
                completion = None  # a later attempt whose start was lost
            if completion is None:
                if key not in self.reported:
                    processed.unknown.append(key)
                    _remember(self.reported, key)
                continue
            if item.num_before != completion.decoder.num_tokens:
                delta = self._end_lost(key, completion, f"the detokenizer missed tokens of "
                                       f"this completion (it holds {completion.decoder.num_tokens}"
                                       f", the next batch starts after {item.num_before})")
            else:
                delta = self._decode(key, completion, item, now_ns, processed)
            out[completion.start.reply_subject].append(delta)
        return processed

    def end_all(self, error: str) -> dict[str, list[TextDelta]]:
        """End every completion held with a resumable error (this copy's bus connection dropped:
        tokens sent to it meanwhile are lost), grouped by api reply subject."""
        out: dict[str, list[TextDelta]] = defaultdict(list)
        for key, completion in list(self.completions.items()):
            out[completion.start.reply_subject].append(self._end_lost(key, completion, error))
        return out

    def _end_lost(self, key: Key, completion: _Completion, error: str) -> TextDelta:
        del self.completions[key]
        _remember(self.stopped, key, completion.attempt)
        return TextDelta(
            request_id=key[0], text="", finish_reason=FinishReason.ERROR, error=error,
            index=key[1], num_prompt_tokens=completion.start.num_prompt_tokens,
            num_output_tokens=completion.decoder.num_tokens, attempt=completion.attempt,
            resumable=True, detokenizer_id=self.instance_id)

    def _start(self, key: Key, start: CompletionStart, attempt: int,
               now_ns: int) -> _Completion:
        decoder = IncrementalDetokenizer(
            self.tokenizer.decode, stop=start.stop,
            include_stop_str_in_output=start.include_stop_str_in_output)
        if start.replay_token_ids:  # taken over from a copy that died: its text went out
            # already; decoding its tokens again restores what it held back for a stop string
            # (or, had they ended it, keeps the completion stopped)
            decoder.step(start.replay_token_ids)
        completion = self.completions[key] = _Completion(decoder, start, now_ns, attempt)
        self.reported.pop(key, None)
        return completion

    def _decode(self, key: Key, completion: _Completion, item: RequestTokens, now_ns: int,
                processed: Processed) -> TextDelta:
        """The item's text; ends the completion (in `processed`) when it ended."""
        decoder = completion.decoder
        delta = decoder.step(item.new_token_ids)
        text, reason = delta.text, FinishReason(item.finish_reason)
        if delta.stopped:
            reason = FinishReason.STOP
            if item.finish_reason == FinishReason.NONE:
                processed.newly_stopped.append((key, completion.attempt))
                _remember(self.stopped, key, completion.attempt)
        elif reason != FinishReason.NONE:
            flushed = decoder.finish()
            text += flushed.text
            if flushed.stopped:
                reason = FinishReason.STOP
        if reason != FinishReason.NONE:
            del self.completions[key]
            processed.ended.append(EndedCompletion(
                key, completion.started_ns, now_ns, completion.start.traceparent,
                decoder.num_tokens, reason))
        return TextDelta(
            request_id=item.request_id, text=text, num_new_tokens=len(item.new_token_ids),
            finish_reason=reason, num_prompt_tokens=completion.start.num_prompt_tokens,
            num_output_tokens=decoder.num_tokens, error=item.error, step_id=item.step_id,
            index=item.index, logprobs=self.token_texts.logprobs(
                item.logprobs, item.new_token_ids) if item.logprobs else [],
            queue_seconds=item.queue_seconds, token_ids=list(item.new_token_ids),
            attempt=item.attempt, resumable=item.resumable, detokenizer_id=self.instance_id,
            num_cached_tokens=item.start.num_cached_tokens if item.start else 0)


def _remember(keys: dict, key: Key, value: object = None) -> None:
    keys[key] = value
    while len(keys) > _MAX_REMEMBERED:
        del keys[next(iter(keys))]

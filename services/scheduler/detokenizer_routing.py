"""Which detokenizer copy decodes which completion: sticky, so decode state stays in one place.

The detokenizer keeps per-completion state (the incremental decode window, text held back
for stop strings), so all tokens of one completion must reach the same copy, in order. The
scheduler, the only sender of tokens, assigns each completion to a live copy by rendezvous
hashing (stable while the set of copies is stable) and sends it there on the copy's own
subject; NATS keeps the order of one publisher's messages on one subject.

A completion's constants (reply subject, stop strings, ...; `CompletionStart`) go to a copy
once: with the first update that copy gets of it. When a copy dies, its completions move to
another copy, whose first update carries the start again with the tokens the dead copy had
(`replay_token_ids`): the new copy decodes them silently, which restores the text the old one
held back for a stop string (its text so far was already delivered), then goes on from the
next tokens. Before any copy is heard from, updates go to the shared subject, where any copy
may take each one: every such update carries the start.

The api that owns a request may name copies it takes for dead (`avoid`): a copy this engine
still counts alive, because its own view lags (it reconnected, which pardons every silence),
would otherwise swallow a short completion whole, and the api, which moved the request off
that copy already, would wait for it for ever.

A copy that gets tokens of a completion it knows nothing of, without a start (the message
with it was lost), reports it (`UnknownCompletion`); `lost` makes the completion's next update
carry the start again, so that the error the scheduler then ends it with reaches its client,
and `ended_error` answers for a completion that ended meanwhile.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

from llmbus.bus import subjects
from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import CompletionStart, FinishReason, RequestTokens

# Ended completions remembered, for a copy that reports one late (oldest dropped).
MAX_ENDED_REMEMBERED = 10_000

Key = tuple[str, int]  # (request id, completion index)


def _weight(key: str, instance_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{instance_id}".encode(),
                                          digest_size=8).digest(), "little")


def preferred_copy(key: Key, alive: set[str]) -> str:
    """The live copy a completion goes to while the set of copies stays as it is."""
    return max(alive, key=lambda i: _weight(f"{key[0]}#{key[1]}", i))


@dataclass
class DetokenizerRouting:
    liveness: Liveness = field(default_factory=Liveness)
    # The copy each running completion went to, which has its start (None: the shared subject).
    assigned: dict[Key, str | None] = field(default_factory=dict)
    sent: dict[Key, list[int]] = field(default_factory=dict)  # tokens so far
    starts: dict[Key, CompletionStart] = field(default_factory=dict)
    # Ended completions: the copy that had each, and its start (insertion-ordered, bounded).
    ended: dict[Key, tuple[str | None, CompletionStart, int]] = field(default_factory=dict)
    #                      (the copy, the start, the attempt)
    # Copies each request's owner takes for dead (bounded like `ended`: kept past the end).
    avoided: dict[str, frozenset[str]] = field(default_factory=dict)

    def avoid(self, request_id: str, copies: list[str]) -> None:
        """The request's owner takes `copies` for dead (as of its latest attempt, which this
        replaces): none of its completions goes there while another copy is alive."""
        self.avoided.pop(request_id, None)
        if copies:
            self.avoided[request_id] = frozenset(copies)
            while len(self.avoided) > MAX_ENDED_REMEMBERED:
                del self.avoided[next(iter(self.avoided))]

    def route(self, updates: list[RequestTokens], now: float) -> dict[str, list[RequestTokens]]:
        """Updates grouped by the subject of the detokenizer copy each completion goes to.

        Sets each update's `start`: the completion's constants where that copy lacks them (a
        completion's first update carries them from the scheduler), none elsewhere."""
        alive = {h.instance_id for h in self.liveness.alive(now)}
        out: dict[str, list[RequestTokens]] = defaultdict(list)
        for update in updates:
            key = (update.request_id, update.index)
            if update.start is not None:  # a completion's first update (a new attempt's too)
                self.starts[key] = update.start
                self.assigned.pop(key, None)
                self.sent[key] = list(update.start.replay_token_ids)
            holder = self.assigned.get(key)
            # Another copy than those the owner avoids; all of them if it avoids every one.
            avoided = self.avoided.get(update.request_id)
            allowed = (alive - avoided or alive) if avoided else alive
            instance = holder if holder in allowed else (
                preferred_copy(key, allowed) if allowed else None)
            start = self.starts.get(key)
            if instance is not None and instance == holder:
                update.start = None  # that copy has it
            elif start is not None:
                replay = self.sent.get(key)
                update.start = (msgspec.structs.replace(start, replay_token_ids=list(replay))
                                if replay else start)
            if update.finish_reason != FinishReason.NONE:
                self.assigned.pop(key, None)
                self.sent.pop(key, None)
                self.starts.pop(key, None)
                if start is not None:
                    self._remember_ended(key, instance, start, update.attempt)
            else:
                self.assigned[key] = instance
                self.sent.setdefault(key, []).extend(update.new_token_ids)
            # No copy heard from yet (start-up): the shared subject, where copies queue.
            subject = (subjects.detokenizer_tokens(instance) if instance is not None
                       else subjects.DETOKENIZER_TOKENS)
            out[subject].append(update)
        return out

    def lost(self, key: Key, instance_id: str) -> bool:
        """Copy `instance_id` holds nothing of this running completion. True if that is the
        copy it went to: its next update then carries the start again, with nothing to replay
        (the caller ends it with an error: text that never reached the client is not made up
        for). False for a completion that is not running, or went to another copy."""
        if key not in self.assigned or self.assigned[key] != instance_id:
            return False
        del self.assigned[key]
        self.sent.pop(key, None)
        return True

    def ended_error(self, key: Key, instance_id: str,
                    error: str) -> tuple[str, RequestTokens] | None:
        """For a completion that ended while copy `instance_id`, which it went to, held nothing
        of it: an update ending it there with `error`, its start included, and the subject to
        send it on (once). None when it did not end on that copy, or too long ago."""
        found = self.ended.get(key)
        if found is None or found[0] != instance_id:
            return None
        del self.ended[key]
        return subjects.detokenizer_tokens(instance_id), RequestTokens(
            request_id=key[0], index=key[1], finish_reason=FinishReason.ERROR, error=error,
            start=found[1], resumable=True, attempt=found[2],
            num_before=len(found[1].replay_token_ids))

    def _remember_ended(self, key: Key, instance: str | None, start: CompletionStart,
                        attempt: int) -> None:
        self.ended[key] = (instance, start, attempt)
        while len(self.ended) > MAX_ENDED_REMEMBERED:
            del self.ended[next(iter(self.ended))]

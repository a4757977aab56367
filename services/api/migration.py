"""What the api, the owner of every request it accepted, keeps to move a request to another
engine mid-stream, and how it judges each text delta that comes back. Pure: no bus, no clock.

Core NATS is at-most-once, and engines die. So the api keeps, per request, the token ids its
client has been sent (each TextDelta carries its own) and the attempt it waits for. When the
request's engine dies, an engine or the bus fails it with a resumable error, or a delta shows
that tokens were lost on the way (it does not start where the last one ended), the api resumes
the request as the next attempt: the same request id, the prompt plus the tokens already
streamed (`ResumedCompletion`), which the new engine computes again and goes on from with the
same sampling state (penalties count them, a seed is seeded by position). Its detokenizer
replays them silently, so text held back for a stop string is held back again. Deltas of an
older attempt, flushed late by a partitioned engine, are stale: dropped, and that attempt is
told to abort. The client sees one stream: no token twice, none missing.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import msgspec

from llmbus.bus.messages import FinishReason, GenerateRequest, ResumedCompletion, TextDelta

# Migrations of one request before its client gets the error (Dynamo's --migration-limit).
DEFAULT_MIGRATION_LIMIT = 3


class Verdict(enum.Enum):
    FORWARD = "forward"  # the next text of the stream: to the client
    STALE = "stale"  # of an older attempt: dropped, and that attempt aborted
    DUPLICATE = "duplicate"  # tokens the client has (a completion that ended): dropped
    RESUME = "resume"  # tokens were lost, or the pipeline failed it: resume elsewhere


@dataclass
class Placement:
    """One request the api owns: where it runs, and what its client was sent."""

    request: GenerateRequest
    queue: asyncio.Queue  # its deltas go there, for the HTTP handler
    scheduler_instance_id: str = ""  # the engine holding the current attempt
    scheduler_reconnects: int = 0  # its reconnects when it took it (Admission)
    attempt: int = 0
    received: dict[int, list[int]] = field(default_factory=dict)  # completion -> token ids
    finished: set[int] = field(default_factory=set)  # completions that ended
    moving: bool = False  # a migration is on its way
    # Why the attempt being admitted failed already (it may fail before its admission is
    # back): it moves again once it is.
    failed_meanwhile: str = ""
    # The copy each completion's text comes from (if it dies, what it held is lost).
    detokenizer_ids: dict[int, str] = field(default_factory=dict)
    aborted_attempts: set[int] = field(default_factory=set)  # stale ones already told
    # The detokenizer copies the current attempt's tokens are not to go to (GenerateRequest).
    avoided_detokenizers: frozenset[str] = frozenset()

    def judge(self, delta: TextDelta) -> Verdict:
        """What to do with a delta; a FORWARD one is recorded as sent."""
        if delta.attempt < self.attempt:
            return Verdict.STALE
        if delta.index in self.finished:
            return Verdict.DUPLICATE
        if delta.finish_reason == FinishReason.ERROR and delta.resumable:
            return Verdict.RESUME
        got = self.received.setdefault(delta.index, [])
        # The detokenizer counts the completion's tokens (a resumed one's replay included).
        if delta.num_output_tokens - len(delta.token_ids) != len(got):
            return Verdict.RESUME
        got.extend(delta.token_ids)
        self.detokenizer_ids[delta.index] = delta.detokenizer_id
        if delta.finish_reason != FinishReason.NONE:
            self.finished.add(delta.index)
        return Verdict.FORWARD

    def unfinished(self) -> list[int]:
        return [i for i in range(self.request.n) if i not in self.finished]

    def decoded_by(self, copies: set[str]) -> bool:
        """Whether an unfinished completion's text comes, or may come, from one of these
        detokenizer copies (one with no text yet may have gone to any)."""
        return any(self.detokenizer_ids.get(i, "") in copies | {""} for i in self.unfinished())

    def next_attempt(self, avoid_instance_id: str = "",
                     avoid_detokenizer_ids: list[str] | None = None) -> GenerateRequest:
        """The request as its next attempt, resuming each unfinished completion from what its
        client has; `avoid_instance_id`: the engine not to route to; `avoid_detokenizer_ids`:
        the detokenizer copies its tokens are not to go to."""
        self.attempt += 1
        unfinished = self.unfinished()
        resumed = ([ResumedCompletion(i, list(self.received.get(i, []))) for i in unfinished]
                   if self.finished or any(self.received.get(i) for i in unfinished) else [])
        self.avoided_detokenizers = frozenset(avoid_detokenizer_ids or [])
        return msgspec.structs.replace(self.request, attempt=self.attempt, resumed=resumed,
                                       avoid_instance_id=avoid_instance_id,
                                       avoid_detokenizer_ids=sorted(self.avoided_detokenizers))

    def end_with_error(self, error: str) -> None:
        """Every unfinished completion ends with `error` (explicit, to the client)."""
        for index in self.unfinished():
            self.finished.add(index)
            self.queue.put_nowait(TextDelta(
                request_id=self.request.request_id, text="", index=index,
                finish_reason=FinishReason.ERROR, error=error, attempt=self.attempt))

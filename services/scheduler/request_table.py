"""The scheduler's books, apart from its planning: the table of the sequences it holds, and the
counters of what it did. Pure bookkeeping: no blocks, no queues, no clock."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from llmbus.services.scheduler.request import Request

# Withdrawals of requests that had not arrived yet, remembered until they do (oldest dropped).
MAX_WITHDRAWN_REMEMBERED = 10_000


class RequestTable:
    """Every sequence of the engine by its `sequence_id`, and the sequences of each api request
    by its `request_id`: the one of n = 1, the n completions, or the prompt they fork from.
    Iterating gives every sequence."""

    def __init__(self) -> None:
        self.sequences: dict[str, Request] = {}
        self.families: dict[str, list[str]] = {}  # request_id -> its sequence_ids
        # withdrawn before they arrived: request id -> up to which attempt (ordered)
        self._withdrawn: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.sequences.values())

    def get(self, sequence_id: str) -> Request | None:
        return self.sequences.get(sequence_id)

    def holds(self, request_id: str) -> bool:
        return request_id in self.families

    def family(self, request_id: str) -> list[Request]:
        """The request's sequences (a new list: the caller may remove them meanwhile)."""
        return [self.sequences[s] for s in self.families.get(request_id, ())]

    def add(self, family: list[Request]) -> None:
        """A new request's sequences, all of one request_id."""
        [request_id] = {r.request_id for r in family}
        assert request_id not in self.families, f"duplicate request id {request_id}"
        self.families[request_id] = [r.sequence_id for r in family]
        for request in family:
            self.sequences[request.sequence_id] = request

    def fork(self, parent: Request, children: list[Request]) -> None:
        """A prefilled parent gives way to its completions."""
        del self.sequences[parent.sequence_id]
        for child in children:
            self.sequences[child.sequence_id] = child
        self.families[parent.request_id] = [c.sequence_id for c in children]

    def remove(self, request: Request) -> None:
        del self.sequences[request.sequence_id]
        family = self.families[request.request_id]
        family.remove(request.sequence_id)
        if not family:
            del self.families[request.request_id]

    def request_ids_for(self, reply_subject: str) -> set[str]:
        """The requests one api copy (its reply subject) owns."""
        return {r.request_id for r in self.sequences.values() if r.reply_subject == reply_subject}

    def withdraw(self, request_id: str, attempt: int = 0) -> list[Request]:
        """The sequences of that attempt of the request (or an earlier one), to drop; none
        yet: it is remembered (`take_withdrawn`)."""
        family = [r for r in self.family(request_id) if r.attempt <= attempt]
        if not family and not self.holds(request_id):
            self._withdrawn[request_id] = attempt
            while len(self._withdrawn) > MAX_WITHDRAWN_REMEMBERED:
                del self._withdrawn[next(iter(self._withdrawn))]
        return family

    def refusal(self, request_id: str, attempt: int = 0) -> str:
        """Why this attempt of the request, arriving now, cannot be admitted ("" if it can):
        this attempt or a later one is held, or it was withdrawn before it came."""
        held = self.family(request_id)
        if held and held[0].attempt >= attempt:
            return (f"duplicate request id {request_id}" if held[0].attempt == attempt
                    else f"request {request_id}: attempt {attempt} is stale (attempt "
                         f"{held[0].attempt} runs here)")
        if self.take_withdrawn(request_id, attempt):
            return f"request {request_id} was withdrawn (admitted elsewhere)"
        return ""

    def take_withdrawn(self, request_id: str, attempt: int = 0) -> bool:
        """Whether this attempt of the request, arriving now, was withdrawn before (and
        forget that). A later attempt is not: it is the request moving on."""
        withdrawn = self._withdrawn.pop(request_id, None)
        return withdrawn is not None and attempt <= withdrawn


@dataclass
class Counters:
    """What the engine did since it started, for its stats (EngineStats) and heartbeats."""

    num_finished: int = 0
    num_preemptions: int = 0
    max_batch_size: int = 0  # the most requests one step carried
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # ... of which were found there
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted
    num_accepted_tokens: int = 0
    num_remote_prefills: int = 0  # disaggregation: prompts sent to a prefill engine
    num_remote_fallbacks: int = 0  # ... of which were prefilled here after all
    num_generated_tokens: int = 0  # output tokens kept (tokens after a stop are not)

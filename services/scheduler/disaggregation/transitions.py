"""A decode engine's remote prefills, as the scheduler's requests see them: the transitions of
a request whose prompt another engine prefills.

    WAITING ── prefill_elsewhere ──▶ REMOTE ── done ──▶ RUNNING, with its first token
       ▲                               │
       └───────────── failed ──────────┘ at the head of the queue, to prefill here
                                         (local_only: never sent away again)

An abort of a REMOTE request ends its try (`cancel`), and the prefill engine is told.

The scheduler owns the queues and the blocks (shared with this class, not copied); this class
moves its requests between them and keeps the feature's books: the prefill engines alive (their
latest heartbeats, kept current by remote_prefill_bus.py), the tries under way (tries.py), and
the rule's decisions, for logs. Pure: no bus, no clock (times are arguments).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

import msgspec

from llmbus.bus.messages import Heartbeat, TokenLogprobs
from llmbus.services.scheduler.block_tables import BlockTables
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.disaggregation.rule import Decision, decide
from llmbus.services.scheduler.disaggregation.tries import RemotePrefills
from llmbus.services.scheduler.request import Request, RequestStatus
from llmbus.services.scheduler.request_table import Counters
from llmbus.services.scheduler.step_time import StepBudget, StepTimeModel

# Appends a token sampled elsewhere to a request (it may end it), and queues its update.
FirstToken = Callable[[Request, int, TokenLogprobs | None, float], None]


class RemotePrefilling:
    def __init__(self, config: SchedulerConfig, step_time: StepTimeModel, counters: Counters,
                 blocks: BlockTables, waiting: deque[Request], running: list[Request],
                 first_token: FirstToken) -> None:
        self.config, self.step_time, self.counters = config, step_time, counters
        self.blocks, self.waiting, self.running = blocks, waiting, running
        self.first_token = first_token
        self.tries = RemotePrefills(config.engine_id)
        self.prefill_engines: list[Heartbeat] = []  # alive now, as their heartbeats said
        self.decisions: list[tuple[Request, Decision]] = []  # for logs: take_decisions()

    def __len__(self) -> int:
        return len(self.tries)

    def requests(self) -> list[Request]:
        return self.tries.requests()

    def prefill_elsewhere(self, request: Request, step: StepBudget, now: float) -> bool:
        """Send the waiting head's prefill to a prefill engine, if the rule says so and its
        blocks can be held here meanwhile (rule.py). Decided once a request: one the rule
        keeps here is not weighed again each step it waits. The caller takes a request sent
        away out of its queue."""
        rule = self.config.disaggregation
        if (rule is None or not self.prefill_engines or request.remote.local_only
                or request.embeds  # its pooling needs the prompt's rows here
                or request.num_computed_tokens >= request.num_prompt_tokens):
            return False
        # Weighed against this step's decodes, as the step's budget began from them.
        decision = decide(rule, request, request.num_computed_tokens, self.prefill_engines,
                          self.step_time, step.decodes, self.config.max_num_batched_tokens,
                          self.config.max_step_seconds)
        self.decisions.append((request, decision))
        engine = decision.engine
        if engine is None:
            request.remote.local_only = True
            return False
        if not self.blocks.reserve(
                request, request.num_prompt_tokens - request.num_computed_tokens):
            return False
        request.status = RequestStatus.REMOTE
        if request.trace.first_scheduled_time is None:
            request.trace.first_scheduled_time = now
        self.tries.start(request, engine.engine_id, engine.instance_id,
                         request.num_computed_tokens // self.config.block_size, now)
        self.counters.num_remote_prefills += 1
        self._count_sent(engine, request)
        return True

    def _count_sent(self, engine: Heartbeat, request: Request) -> None:
        """Until its next heartbeat, count what was just sent there (a burst must not all go
        to the engine whose last heartbeat looked idlest)."""
        num_blocks = -(-request.num_prompt_tokens // self.config.block_size)
        self.prefill_engines[self.prefill_engines.index(engine)] = msgspec.structs.replace(
            engine, num_queued_tokens=engine.num_queued_tokens + request.num_prompt_tokens,
            num_free_blocks=engine.num_free_blocks - num_blocks)

    def done(self, transfer_id: str, token_id: int, logprobs: TokenLogprobs | None,
             now: float = 0.0, num_bytes: int = 0) -> bool:
        """A prefill engine put the prompt's KV in this engine's blocks and sampled its first
        token: the request decodes here from now on. False: a stale or unknown try."""
        remote = self.tries.end(transfer_id, cancel=False)
        if remote is None:
            return False
        request = remote.request
        request.remote.tries.append((remote.engine_id, remote.started, now, num_bytes))
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        # In arrival order: the newest are preempted first, and this one's KV just came.
        at = bisect.bisect_right([r.trace.arrival_time for r in self.running],
                                 request.trace.arrival_time)
        self.running.insert(at, request)
        request.trace.first_token_time = now
        self.blocks.cache_full_blocks(request)  # the prompt's KV is here now
        self.first_token(request, token_id, logprobs, now)
        return True

    def failed(self, transfer_id: str, now: float = 0.0) -> bool:
        """The try is given up (its engine died, refused or took too long): the request
        prefills here, first in the queue (its cached prefix is matched again). False: not
        pending."""
        remote = self.tries.end(transfer_id, cancel=True)
        if remote is None:
            return False
        request = remote.request
        request.remote.tries.append((remote.engine_id, remote.started, now, 0))
        self.blocks.release(request)
        request.status = RequestStatus.WAITING
        request.remote.local_only = True
        self.counters.num_remote_fallbacks += 1
        self.waiting.appendleft(request)
        return True

    def cancel(self, request: Request) -> None:
        """A REMOTE request ends here (aborted, failed): its try ends, and the prefill engine
        is told. The caller frees its blocks."""
        self.tries.end(request.remote.transfer_id, cancel=True)

    def take_decisions(self) -> list[tuple[Request, Decision]]:
        """Where the rule sent each prompt it weighed since the last call, and why."""
        decisions, self.decisions = self.decisions, []
        return decisions

# Over 300 lines: one class whose planning steps share every field (its KV blocks, request
# table and counters, outputs and loop rules live in kv_manager.py, request_table.py,
# outputs.py and engine_loop.py).
"""Continuous batching over paged KV blocks with a prefix cache: the scheduler's pure core.

There is no prefill phase and no decode phase. Each request has tokens (prompt + sampled
output) and computed tokens (whose KV is in the cache); every step, computed tokens catch up
with tokens under a token budget. Running requests go first, oldest first, so decodes never
stall behind a long prompt; then waiting requests are admitted, a long prompt taking several
steps (chunked prefill); while anything decodes, prompt chunks take only what keeps the
step within its time target (step_time.py), so a long prompt is spread over as many steps as
it takes and decodes keep their cadence. A new request first reuses the longest cached
prefix of full blocks. When a running request needs a block and none is free or evictable,
the newest running request is preempted: its blocks are freed and it returns to the front of
the queue, to be recomputed later (cheaply, thanks to the prefix cache).

The scheduler plans ahead: `schedule()` counts every token it asks the executor to sample as
already there (pending), so step N+1 can be planned and sent while step N runs. `update()`
fills in the sampled values; a request that turns out to have finished at step N simply drops
what step N+1 computed for it.

n > 1: one parent request prefills the prompt but its last token, then forks into n
completions that share the parent's blocks; each copies the shared partial block before it
writes into it (copy-on-write).

No I/O, no clock, no torch.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

import msgspec

from llmbus.bus.messages import (
    BlockCopy,
    FinishReason,
    Heartbeat,
    KvDestination,
    NewRequestData,
    RequestTokens,
    ResumedCompletion,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from llmbus.services.scheduler.admission import AdmissionError, params_for, resolve_max_tokens
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.disaggregation import Decision, decide
from llmbus.services.scheduler.kv_manager import KVManager
from llmbus.services.scheduler.multi_step import (
    decode_steps,
    max_decode_steps,
    multi_step_decode,
)
from llmbus.services.scheduler.outputs import end_updates, stop_reason, token_update
from llmbus.services.scheduler.remote_prefills import RemotePrefills
from llmbus.services.scheduler.request import Request, RequestStatus
from llmbus.services.scheduler.request_table import Counters, RequestTable
from llmbus.services.scheduler.speculation import drafts_for, verified, waits_for_drafts
from llmbus.services.scheduler.step_time import StepBudget, StepShape, StepTimeModel


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if not (config.num_blocks and config.block_size and config.max_model_len):
            raise ValueError("the KV cache's shape is the executor's: "
                             "SchedulerConfig.with_executor(info)")
        self.config = config
        self.kv = KVManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.table = RequestTable()
        self.counters = Counters()
        self.num_steps = 0
        self.step_time = StepTimeModel()  # sizes prompt chunks and multi-step plans
        self._ended_updates: list[RequestTokens] = []  # aborts, sent with the next update
        self._forget_ids: list[str] = []  # the executor drops these before the next step
        self._preempted_ids: list[str] = []
        self._copies: list[BlockCopy] = []
        self._finished: list[Request] = []  # for the adapter's traces: take_finished()
        # Disaggregated prefill (a decode engine): the prefill engines alive now (their
        # latest heartbeats, kept current by the adapter), and the prompts they prefill.
        self.prefill_engines: list[Heartbeat] = []
        self.remote = RemotePrefills(config.engine_id)
        self.decisions: list[tuple[Request, Decision]] = []  # for logs: take_decisions()

    # ------------------------------------------------------------------ admission

    def add_request(self, request_id: str, reply_subject: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float = 0.0, n: int = 1,
                    traceparent: str = "", attempt: int = 0,
                    resumed: Sequence[ResumedCompletion] = (),
                    kv_destination: KvDestination | None = None) -> None:
        """Queue a request (n completions of it), or raise AdmissionError if it can never run
        (or was withdrawn before it arrived).

        A migrated request comes as a later `attempt`, which supersedes (aborts) an earlier one
        held here; with `resumed`, each of those completions continues from the tokens it
        already streamed (computed again with the prompt, counted as output)."""
        held = self.table.family(request_id)
        if held and held[0].attempt >= attempt:
            raise AdmissionError(f"duplicate request id {request_id}" if held[0].attempt
                                 == attempt else f"request {request_id}: attempt {attempt} "
                                 f"is stale (attempt {held[0].attempt} runs here)")
        if self.table.take_withdrawn(request_id, attempt):
            raise AdmissionError(f"request {request_id} was withdrawn (admitted elsewhere)")
        max_tokens = resolve_max_tokens(self.config, self.kv.num_usable,
                                        len(prompt_token_ids), params, n)
        self.abort_request(request_id)  # an earlier attempt: its owner moved on
        # The executor's sequences of each attempt are distinct: a step of the old attempt
        # still in flight can never feed the new one.
        base = request_id if attempt == 0 else f"{request_id}~{attempt}"

        def make(sequence_id: str, index: int, num_forks: int = 1,
                 output_token_ids: Sequence[int] = ()) -> Request:
            request = Request(sequence_id, request_id, index, reply_subject,
                              list(prompt_token_ids), params_for(params, index),
                              max_tokens=max_tokens, arrival_time=arrival_time,
                              num_forks=num_forks, traceparent=traceparent,
                              output_token_ids=list(output_token_ids), attempt=attempt)
            request.num_sent_tokens = len(output_token_ids)  # the new detokenizer replays them
            request.kv_destination = kv_destination  # a prefill for another engine
            return request

        if resumed:
            family = [make(base if n == 1 else f"{base}#{c.index}", c.index,
                           output_token_ids=c.output_token_ids) for c in resumed]
        elif n == 1:
            family = [make(base, 0)]
        elif len(prompt_token_ids) == 1:  # nothing to share: n independent completions
            family = [make(f"{base}#{i}", i) for i in range(n)]
        else:
            family = [make(f"{base}#prompt", 0, num_forks=n)]
        self.table.add(family)
        for request in family:
            last = request.output_token_ids[-1:]
            reason = (stop_reason(request, last[0], self.config.eos_token_ids) if last
                      else FinishReason.NONE)
            if reason is FinishReason.NONE:
                self.waiting.append(request)
            else:  # it had ended, and only the message saying so was lost
                self._finish(request, reason)
                self._ended_updates.extend(end_updates(request, self.num_steps))

    def abort_request(self, request_id: str, index: int | None = None,
                      error: str = "", up_to_attempt: int | None = None,
                      resumable: bool = False) -> bool:
        """End a request (or one of its completions) wherever it is; blocks are freed now.
        With an `error` it ends as failed (ERROR), not aborted. `up_to_attempt` spares a later
        attempt. False: nothing of it is here."""
        reason = FinishReason.ERROR if error else FinishReason.ABORT
        ended = False
        for request in self.table.family(request_id):
            if index is not None and request.index != index and not request.is_parent:
                continue
            if up_to_attempt is not None and request.attempt > up_to_attempt:
                continue
            self._remove(request)
            self._finish(request, reason)
            self._ended_updates.extend(end_updates(request, self.num_steps, error, resumable))
            ended = True
        return ended

    def withdraw(self, request_id: str, attempt: int = 0) -> None:
        """The router gave up waiting for this engine's admission and sent the request to
        another engine: drop it without a word downstream (the other engine's output is the
        one the client gets), or, not here yet, refuse it when it comes."""
        for request in self.table.withdraw(request_id, attempt):
            self._remove(request)
            self._drop(request, FinishReason.ABORT)  # never served: no spans, no counts

    def abort_for_reply_subject(self, reply_subject: str) -> int:
        """Abort every request whose api copy (reply subject) is gone; returns how many."""
        request_ids = self.table.request_ids_for(reply_subject)
        for request_id in request_ids:
            self.abort_request(request_id)
        return len(request_ids)

    @property
    def num_queued_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.waiting)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Prompt tokens still to compute, waiting or running: a prefill engine's backlog."""
        return self.num_queued_tokens + sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                                            for r in self.running)

    @property
    def num_held(self) -> int:
        """Requests held in any state, those another engine prefills included (drain)."""
        return len(self.table)

    def expire_waiting(self, now: float, timeout: float) -> list[RequestTokens]:
        """End requests that waited longer than `timeout` for their first step (explicitly,
        with an error), so that an overloaded engine never holds a client forever."""
        expired = [r for r in self.waiting
                   if r.first_scheduled_time is None and now - r.arrival_time > timeout]
        updates = []
        for request in expired:
            self._remove(request)
            self._finish(request, FinishReason.ERROR)
            updates.extend(end_updates(
                request, self.num_steps,
                f"the request waited more than {timeout:.0f} s in the queue"))
        return updates

    def fail_all(self, error: str, resumable: bool = True) -> list[RequestTokens]:
        """End every request with an error (the executor failed, the bus lost messages); returns
        their updates. The error is the engine's, not the requests': by default resumable.

        The prefix cache is emptied too: blocks planned in the failed step may never have
        been written.
        """
        updates = []
        for request in list(self.running) + list(self.waiting) + self.remote.requests():
            self._remove(request)
            self._finish(request, FinishReason.ERROR)
            updates.extend(end_updates(request, self.num_steps, error, resumable))
        self.kv.clear_cache()
        return updates

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_bookkeeping(self) -> bool:
        """Ended requests the executor still holds: worth a plan of their own when idle."""
        return bool(self._forget_ids or self._preempted_ids or self.remote.closed)

    def take_ended_updates(self) -> list[RequestTokens]:
        updates, self._ended_updates = self._ended_updates, []
        return updates

    def take_decisions(self) -> list[tuple[Request, Decision]]:
        """Where the rule sent each prompt it weighed since the last call, and why."""
        decisions, self.decisions = self.decisions, []
        return decisions

    def take_finished(self) -> list[Request]:
        """Requests that ended since the last call (for spans; their blocks are gone)."""
        finished, self._finished = self._finished, []
        return finished

    # ------------------------------------------------------------------ scheduling

    def schedule(self, now: float = 0.0) -> StepPlan:
        """Choose this step's work, reserve its blocks, and advance computed tokens.

        `now` only stamps requests for traces and queue-time metrics.
        """
        for parent in [r for r in self.running if r.is_parent
                       and r.num_computed_tokens >= r.target_tokens]:
            self._fork(parent)
        scheduled: list[tuple[Request, int, int]] = []  # (request, tokens, decode steps)
        step = StepBudget(self.step_time, self._decode_shape(), self.config.max_step_seconds)
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, step)
        self._schedule_waiting(budget, scheduled, step, now)
        plan = StepPlan(step_id=self.num_steps, finished_sequence_ids=self._forget_ids,
                        preempted_sequence_ids=self._preempted_ids, copy_blocks=self._copies,
                        closed_transfers=self.remote.take_closed())
        self._forget_ids, self._preempted_ids, self._copies = [], [], []
        for request, num_new, num_steps in scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if request.num_computed_tokens < request.num_prompt_tokens:
                request.prefill_chunks.append((now, num_new))
            plan.scheduled.append(self._plan_item(request, num_new, plan, num_steps))
        self.num_steps += 1
        self.counters.max_batch_size = max(self.counters.max_batch_size, len(plan.scheduled))
        return plan

    def _decode_shape(self) -> StepShape:
        """The running requests that decode a token this step (what prompt chunks must not
        stall), as the step-time model sees them."""
        shape = StepShape()
        for r in self.running:
            if (r.target_tokens - r.num_computed_tokens == 1 and not r.is_parent
                    and not r.draft_token_ids
                    and len(r.output_token_ids) + r.num_pending_tokens < r.max_tokens):
                shape.add(r.num_computed_tokens, 1)
        return shape

    def _schedule_running(self, budget: int, scheduled: list[tuple[Request, int, int]],
                          step: StepBudget) -> int:
        """Running requests first, oldest first; the newest give way when blocks run out.
        Appends to `scheduled`; returns the token budget left."""
        index, speculating = 0, self.config.num_speculative_tokens > 0
        multi_step = multi_step_decode(self.config, len(self.running), len(self.waiting))
        most_steps = (max_decode_steps(self.config, self.step_time.predict(step.shape))
                      if multi_step else 1)
        if most_steps > 1 and not self.step_time.knows_context(
                max((r.num_computed_tokens for r in self.running), default=0)):
            most_steps = 1  # one forward first, to learn what these contexts cost
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            start = request.num_computed_tokens
            prompt = request.target_tokens - start > 1
            if prompt:  # a chunk of its prompt: within the step's time
                num_new = step.prompt_chunk(start, num_new)
            drafts = drafts_for(request, self.config, budget) if num_new and speculating else []
            if num_new == 0 or (speculating and not drafts
                                and waits_for_drafts(request, self.config)):
                index += 1
                continue
            if prompt:
                step.take(start, num_new)
            elif drafts:
                step.add_drafts(start, len(drafts))
            num_new += len(drafts)
            num_steps = (decode_steps(request, self.config, budget, most_steps)
                         if multi_step else 1)
            if num_steps > 1 and not self._reserve_blocks(request, num_new + num_steps - 1):
                num_steps = 1  # the further steps are not worth preempting anyone for
            while not self._reserve_blocks(request, num_new + num_steps - 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    return budget  # it preempted itself; everything after it is gone too
            request.draft_token_ids = drafts
            scheduled.append((request, num_new, num_steps))
            budget -= num_new + num_steps - 1
            index += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int, int]],
                          step: StepBudget, now: float) -> None:
        """Then waiting requests, in order, while budget, sequence slots and blocks allow."""
        num_seqs = sum(r.num_forks for r in self.running) + len(self.remote)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if (num_seqs + request.num_forks > self.config.max_num_seqs
                    or request.draft_token_ids):  # preempted while its drafts are verified
                break
            looked_up = self.kv.tree is not None and request.num_computed_tokens == 0
            num_matched = self._match_prefix(request)
            if self._prefill_elsewhere(request, step, now):
                self.waiting.popleft()
                num_seqs += request.num_forks
                if looked_up:
                    self.counters.num_prefix_query_tokens += request.num_prompt_tokens
                    self.counters.num_prefix_hit_tokens += num_matched * self.config.block_size
                continue
            num_new = step.prompt_chunk(request.num_computed_tokens,
                                        self._num_new_tokens(request, budget))
            if num_new == 0 or not self._reserve_blocks(request, num_new):
                self._release_blocks(request)  # give back the matched prefix
                break
            step.take(request.num_computed_tokens, num_new)
            if looked_up:  # counted once, when admitted: a head that waits asks again
                self.counters.num_prefix_query_tokens += request.target_tokens
                self.counters.num_prefix_hit_tokens += num_matched * self.config.block_size
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new, 1))
            budget -= num_new
            num_seqs += request.num_forks

    def _prefill_elsewhere(self, request: Request, step: StepBudget, now: float) -> bool:
        """Send the waiting head's prefill to a prefill engine, if the rule says so and its
        blocks can be held here meanwhile (disaggregation.py). Decided once a request: one
        the rule keeps here is not weighed again each step it waits."""
        rule = self.config.disaggregation
        if (rule is None or not self.prefill_engines or request.local_only
                or request.num_computed_tokens >= request.num_prompt_tokens):
            return False
        # Weighed against this step's decodes, as the step's budget began from them.
        decision = decide(rule, request, request.num_computed_tokens, self.prefill_engines,
                          self.step_time, step.decodes, self.config.max_num_batched_tokens,
                          self.config.max_step_seconds)
        self.decisions.append((request, decision))
        if decision.engine is None:
            request.local_only = True
            return False
        if not self._reserve_blocks(
                request, request.num_prompt_tokens - request.num_computed_tokens):
            return False
        request.status = RequestStatus.REMOTE
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        engine = decision.engine
        self.remote.start(request, engine.engine_id, engine.instance_id,
                          request.num_computed_tokens // self.config.block_size, now)
        self.counters.num_remote_prefills += 1
        # Until its next heartbeat, count what was just sent there (a burst must not all go to
        # the engine whose last heartbeat looked idlest).
        num_blocks = -(-request.num_prompt_tokens // self.config.block_size)
        self.prefill_engines[self.prefill_engines.index(engine)] = msgspec.structs.replace(
            engine, num_queued_tokens=engine.num_queued_tokens + request.num_prompt_tokens,
            num_free_blocks=engine.num_free_blocks - num_blocks)
        return True

    def remote_done(self, transfer_id: str, token_id: int,
                    logprobs: TokenLogprobs | None, now: float = 0.0,
                    num_bytes: int = 0) -> bool:
        """A prefill engine put the prompt's KV in this engine's blocks and sampled its first
        token: the request decodes here from now on. False: a stale or unknown try."""
        remote = self.remote.end(transfer_id, cancel=False)
        if remote is None:
            return False
        request = remote.request
        request.remote_prefills.append((remote.engine_id, remote.started, now, num_bytes))
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        # In arrival order: the newest are preempted first, and this one's KV just came.
        at = bisect.bisect_right([r.arrival_time for r in self.running], request.arrival_time)
        self.running.insert(at, request)
        request.first_token_time = now
        self._cache_full_blocks(request)  # the prompt's KV is here now
        self._append_tokens(request, [(token_id, logprobs)], now)
        self._ended_updates.append(token_update(request, self.num_steps))
        return True

    def remote_failed(self, transfer_id: str, now: float = 0.0) -> bool:
        """The try is given up (its engine died, refused or took too long): the request
        prefills here, first in the queue (its cached prefix is matched again). False: not
        pending."""
        remote = self.remote.end(transfer_id, cancel=True)
        if remote is None:
            return False
        request = remote.request
        request.remote_prefills.append((remote.engine_id, remote.started, now, 0))
        self._release_blocks(request)
        request.status = RequestStatus.WAITING
        request.local_only = True
        self.counters.num_remote_fallbacks += 1
        self.waiting.appendleft(request)
        return True

    def unschedule_empty(self, plan: StepPlan) -> None:
        """Take back a plan with nothing scheduled: its bookkeeping rides the next plan."""
        assert not plan.scheduled
        self._forget_ids = plan.finished_sequence_ids + self._forget_ids
        self._preempted_ids = plan.preempted_sequence_ids + self._preempted_ids
        self._copies = plan.copy_blocks + self._copies
        self.remote.closed = plan.closed_transfers + self.remote.closed
        self.num_steps -= 1

    def _plan_item(self, request: Request, num_new: int, plan: StepPlan,
                   num_steps: int = 1) -> ScheduledRequest:
        if not request.known_to_executor:
            request.known_to_executor = True
            plan.new_requests.append(NewRequestData(  # a resumed request's output with it
                request.sequence_id, request.prompt_token_ids, request.params,
                request.traceparent, output_token_ids=list(request.output_token_ids),
                kv_destination=request.kv_destination))
        start = request.num_computed_tokens
        end = start + num_new
        drafts = request.draft_token_ids
        sample = not request.is_parent and end - len(drafts) == request.num_tokens
        item = ScheduledRequest(
            sequence_id=request.sequence_id, start=start, num_tokens=num_new,
            new_block_ids=request.block_table[request.num_blocks_sent:], sample=sample,
            draft_token_ids=list(drafts), num_steps=num_steps)
        request.num_blocks_sent = len(request.block_table)
        request.num_computed_tokens = end + num_steps - 1  # each further step computes one
        request.num_pending_tokens += sample * num_steps
        self._cache_full_blocks(request)
        return item

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if len(request.output_token_ids) + request.num_pending_tokens >= request.max_tokens:
            return 0  # its last token is on the way: it finishes when the result arrives
        if request.draft_token_ids:
            return 0  # how far it got is known once its drafts are verified
        return min(request.target_tokens - request.num_computed_tokens, budget)

    def _match_prefix(self, request: Request) -> int:
        """Reuse cached full blocks of the request's tokens; returns the number of blocks.

        At least one token is left to compute: the step needs its logits (or, for a parent,
        its KV must be written by a step before the fork).
        """
        if request.num_computed_tokens:
            return 0
        block_ids = self.kv.match(request.token_ids(),
                                  (request.target_tokens - 1) // self.config.block_size)
        request.block_table = block_ids
        request.num_cached_blocks = len(block_ids)
        request.num_computed_tokens = len(block_ids) * self.config.block_size
        return len(block_ids)

    def _cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full blocks whose tokens are known to the prefix cache."""
        num_full = min(request.num_computed_tokens, request.num_known_tokens) \
            // self.config.block_size
        if num_full > request.num_cached_blocks:
            self.kv.cache(request.token_ids()[:num_full * self.config.block_size],
                          request.block_table[:num_full])
            request.num_cached_blocks = num_full

    def _reserve_blocks(self, request: Request, num_new: int) -> bool:
        """Make the block table hold the tokens up to num_computed + num_new, if blocks allow.

        The first block written may be shared (forked completions): it is copied first.
        """
        size = self.config.block_size
        table = request.block_table
        first = request.num_computed_tokens // size
        shared = first < len(table) and self.kv.is_shared(table[first])
        num_needed = max(-(-(request.num_computed_tokens + num_new) // size) - len(table)
                         + shared, shared)
        if not self.kv.can_reserve(num_needed):
            return False
        blocks = self.kv.reserve(num_needed)
        if shared:
            assert request.num_blocks_sent <= first, "copy-on-write of a block already sent"
            copy = blocks.pop(0)
            self._copies.append(BlockCopy(src=table[first], dst=copy))
            self.kv.release([table[first]])
            table[first] = copy
        table.extend(blocks)
        return True

    def _fork(self, parent: Request) -> None:
        """Replace a prefilled parent by its n completions, sharing its blocks."""
        position = self.running.index(parent)
        children = []
        base = parent.sequence_id.removesuffix("#prompt")  # the attempt's, as add_request's
        for i in range(parent.num_forks):
            child = Request(
                f"{base}#{i}", parent.request_id, i, parent.reply_subject,
                parent.prompt_token_ids, params_for(parent.params, i),
                max_tokens=parent.max_tokens, arrival_time=parent.arrival_time,
                num_computed_tokens=parent.num_computed_tokens,
                block_table=list(parent.block_table),
                num_cached_blocks=parent.num_cached_blocks, status=RequestStatus.RUNNING,
                traceparent=parent.traceparent,
                first_scheduled_time=parent.first_scheduled_time,
                prefill_chunks=list(parent.prefill_chunks), attempt=parent.attempt)
            self.kv.lock(child.block_table)
            children.append(child)
        self.running[position:position + 1] = children
        self.table.fork(parent, children)
        self._release_blocks(parent)
        if parent.known_to_executor:
            self._forget_ids.append(parent.sequence_id)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue."""
        self.running.remove(request)
        self._release_blocks(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        if request.known_to_executor:
            self._preempted_ids.append(request.sequence_id)
        self.waiting.appendleft(request)

    def _release_blocks(self, request: Request) -> None:
        self.kv.release(request.block_table)
        request.block_table = []
        request.num_cached_blocks = 0
        request.num_blocks_sent = 0
        request.num_computed_tokens = 0

    # ------------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult,
               now: float = 0.0) -> list[RequestTokens]:
        """Fill in a step's sampled tokens; returns the token updates for the detokenizer."""
        updates = self.take_ended_updates()
        self.step_time.observe(plan, result.forward_seconds)
        sampled = iter(result.sampled_token_ids)
        logprobs = iter(result.logprobs or [None] * len(result.sampled_token_ids))
        counts = iter(result.num_sampled) if result.num_sampled else None
        for item in plan.scheduled:
            if not item.sample:
                continue
            count = next(counts) if counts is not None else 1
            tokens = ([(next(sampled), next(logprobs))] if count == 1
                      else [(next(sampled), next(logprobs)) for _ in range(count)])
            request = self.table.get(item.sequence_id)
            if request is None:
                continue  # it finished or was aborted after this step was planned
            request.num_pending_tokens -= item.num_steps
            if item.draft_token_ids:
                self.counters.num_draft_tokens += len(item.draft_token_ids)
                self.counters.num_accepted_tokens += count - 1
                verified(request, item.start, item.num_tokens, count - 1)
            if request.first_token_time is None:
                request.first_token_time = now
            self._append_tokens(request, tokens, now)
            updates.append(token_update(request, self.num_steps))
        return updates

    def _append_tokens(self, request: Request,
                       tokens: list[tuple[int, TokenLogprobs | None]], now: float) -> None:
        """Add a step's tokens to the request, in order, until one ends it (the rest of a
        verified run after a stop token, or past max_tokens, is dropped)."""
        for token_id, token_logprobs in tokens:
            request.output_token_ids.append(token_id)
            self.counters.num_generated_tokens += 1
            if token_logprobs is not None:
                request.output_logprobs.append(token_logprobs)
            reason = stop_reason(request, token_id, self.config.eos_token_ids)
            if reason is not FinishReason.NONE:
                self._remove(request)
                self._finish(request, reason)
                request.finish_time = now
                return
        self._cache_full_blocks(request)

    def _remove(self, request: Request) -> None:
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.REMOTE:
            self.remote.end(request.transfer_id, cancel=True)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._drop(request, reason)
        self.counters.num_finished += 1
        self._finished.append(request)

    def _drop(self, request: Request, reason: FinishReason) -> None:
        """Forget a request (already out of the queues): blocks, ids, the executor's copy."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._release_blocks(request)
        self.table.remove(request)
        if request.known_to_executor:
            self._forget_ids.append(request.sequence_id)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Reference counts equal the owners (requests + cache); no block is lost. For tests."""
        self.kv.check(r.block_table for r in self.table)
        assert len(self.running) + len(self.waiting) + len(self.remote) == len(self.table)

# Over 300 lines: one class for a request's life, from admission through its results to every
# way it ends (plans: planner.py, blocks: block_tables.py, books: request_table.py, out: outputs).
"""Continuous batching over paged KV blocks with a prefix cache: the scheduler's pure core.

There is no prefill phase and no decode phase. Each request has tokens (prompt + sampled output)
and computed tokens (whose KV is in the cache); every step, computed tokens catch up with tokens
under a token budget and a time target (planner.py, step_time.py), so decodes never stall behind
a long prompt, which is spread over as many steps as it takes (chunked prefill). A new request
first reuses the longest cached prefix of full blocks. When blocks run out, the newest running
request is preempted, to be recomputed later (cheaply: the prefix cache).

The scheduler plans ahead: `schedule()` counts every token it asks the executor to sample as
already there (pending), so step N+1 can be planned and sent while step N runs. `update()` fills
in the sampled values; a request that turns out to have finished at step N simply drops what
step N+1 computed for it.

n > 1: a parent request prefills the prompt but its last token, then forks into n completions
sharing its blocks (copy-on-write of the shared partial block). An embedding request computes
its prompt and ends with the executor's pooled vector.

Here: what the engine holds, and each request's life (admitted, results, ended); each step's
plan is planner.py's, each request's blocks block_tables.py's, the prompts other engines prefill
disaggregation/'s. No I/O, no clock, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from llmbus.bus.messages import (
    FinishReason,
    KvDestination,
    RequestTokens,
    ResumedCompletion,
    SamplingParams,
    StepPlan,
    StepProgress,
    StepResult,
    TokenLogprobs,
)
from llmbus.services.scheduler.admission import (
    AdmissionError,
    admitted,
    enqueue,
    refuse_task,
    resolve_max_tokens,
)
from llmbus.services.scheduler.block_tables import BlockTables
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.disaggregation.transitions import RemotePrefilling
from llmbus.services.scheduler.kv_manager import KVManager
from llmbus.services.scheduler.outputs import end_updates, stop_reason, token_update
from llmbus.services.scheduler.planner import StepPlanner
from llmbus.services.scheduler.request import (
    Embedded,
    Request,
    RequestStatus,
    Trace,
)
from llmbus.services.scheduler.request_table import Counters, RequestTable
from llmbus.services.scheduler.speculation import verified
from llmbus.services.scheduler.step_time import StepTimeModel
from llmbus.services.scheduler.streamed_forwards import StreamedForwards


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if not (config.num_blocks and config.block_size and config.max_model_len):
            raise ValueError("the KV cache's shape is the executor's: "
                             "SchedulerConfig.with_executor(info)")
        self.config = config
        self.kv = KVManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.blocks = BlockTables(self.kv)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.table = RequestTable()
        self.counters = Counters()
        self.num_steps = 0
        self.step_time = StepTimeModel()  # sizes prompt chunks and multi-step plans
        self._ended_updates: list[RequestTokens] = []  # aborts, sent with the next update
        self._finished: list[Request] = []  # for the adapter's traces: take_finished()
        self._embedded: list[Embedded] = []  # embedding requests ended: take_embedded()
        self._streamed = StreamedForwards()  # a multi-step plan's tokens sent before its result
        # Disaggregated prefill (a decode engine): the prompts prefill engines prefill.
        self.remote = RemotePrefilling(config, self.step_time, self.counters, self.blocks,
                                       self.waiting, self.running, self._first_token)
        self.planner = StepPlanner(config, self.step_time, self.blocks, self.waiting,
                                   self.running, self.table, self.counters, self.remote)

    def swap(self, config: SchedulerConfig | None = None,
             step_time: StepTimeModel | None = None) -> None:
        """Another config or step-time model, between steps (tests do), for all who plan."""
        for holder in (self, self.planner, self.remote):
            holder.config = config or holder.config
            holder.step_time = step_time or holder.step_time

    # ------------------------------------------------------------------ admission

    def add_request(self, request_id: str, reply_subject: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float = 0.0, n: int = 1,
                    traceparent: str = "", attempt: int = 0,
                    resumed: Sequence[ResumedCompletion] = (),
                    kv_destination: KvDestination | None = None) -> None:
        """Queue a request (n completions of it), or raise AdmissionError if it can never run
        here (or was withdrawn before it arrived). A migrated request comes as a later
        `attempt`, which supersedes (aborts) an earlier one held here; with `resumed`, each of
        those completions continues from the tokens it already streamed (counted as output)."""
        refusal = self.table.refusal(request_id, attempt) or refuse_task(
            self.config, params, len(prompt_token_ids))
        if refusal:
            raise AdmissionError(refusal)
        max_tokens = resolve_max_tokens(self.config, self.kv.num_usable,
                                        len(prompt_token_ids), params, n)
        self.abort_request(request_id)  # an earlier attempt: its owner moved on
        family = admitted(request_id, reply_subject, prompt_token_ids, params, max_tokens, n,
                          Trace(traceparent=traceparent, arrival_time=arrival_time), attempt,
                          resumed, kv_destination)
        self.table.add(family)
        for request in family:
            last = request.output_token_ids[-1:]
            reason = (stop_reason(request, last[0], self.config.eos_token_ids) if last
                      else FinishReason.NONE)
            if reason is FinishReason.NONE:
                enqueue(self.waiting, request)
            else:  # it had ended, and only the message saying so was lost
                self._finish(request, reason)
                self._ended_updates.extend(end_updates(request, self.num_steps))

    def abort_request(self, request_id: str, index: int | None = None,
                      error: str = "", up_to_attempt: int | None = None,
                      resumable: bool = False) -> bool:
        """End a request (or one of its completions) wherever it is; blocks are freed now.
        With an `error` it ends as failed (ERROR), not aborted. `up_to_attempt` spares a later
        attempt. False: nothing of it is here."""
        ended = [r for r in self.table.family(request_id)
                 if (index is None or r.index == index or r.is_parent)
                 and (up_to_attempt is None or r.attempt <= up_to_attempt)]
        reason = FinishReason.ERROR if error else FinishReason.ABORT
        self._ended_updates.extend(self._end(ended, reason, error, resumable))
        return bool(ended)

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
                   if r.trace.first_scheduled_time is None and now - r.trace.arrival_time > timeout]
        return self._end(expired, FinishReason.ERROR,
                         f"the request waited more than {timeout:.0f} s in the queue")

    def fail_all(self, error: str, resumable: bool = True) -> list[RequestTokens]:
        """End every request with an error (the executor failed, the bus lost messages); returns
        their updates. The error is the engine's, not the requests': by default resumable. The
        prefix cache is emptied too: blocks planned in the failed step may never be written."""
        held = list(self.running) + list(self.waiting) + self.remote.requests()
        updates = self._end(held, FinishReason.ERROR, error, resumable)
        self.kv.clear_cache()
        return updates

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_bookkeeping(self) -> bool:
        """Ended requests the executor still holds: worth a plan of their own when idle."""
        return self.planner.has_bookkeeping

    def take_ended_updates(self) -> list[RequestTokens]:
        updates, self._ended_updates = self._ended_updates, []
        return updates

    def take_embedded(self) -> list[Embedded]:
        """Embedding requests ended since the last call: the adapter answers their api."""
        embedded, self._embedded = self._embedded, []
        return embedded

    def take_finished(self) -> list[Request]:
        """Requests that ended since the last call (for spans; their blocks are gone)."""
        finished, self._finished = self._finished, []
        return finished

    # ------------------------------------------------------------------ scheduling

    def schedule(self, now: float = 0.0) -> StepPlan:
        """Choose this step's work, reserve its blocks, and advance computed tokens
        (planner.py).

        `now` only stamps requests for traces and queue-time metrics.
        """
        plan = self.planner.plan(self.num_steps, now)
        self.num_steps += 1
        return plan

    def unschedule_empty(self, plan: StepPlan) -> None:
        """Take back a plan with nothing scheduled: its bookkeeping rides the next plan."""
        self.planner.unplan_empty(plan)
        self.num_steps -= 1

    # ------------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult,
               now: float = 0.0) -> list[RequestTokens]:
        """Fill in a step's sampled tokens and pooled vectors; returns the token updates for
        the detokenizer."""
        updates = self.take_ended_updates()
        self.step_time.observe(plan, result.forward_seconds)
        sampled = iter(result.sampled_token_ids)
        logprobs = iter(result.logprobs or [None] * len(result.sampled_token_ids))
        counts = iter(result.num_sampled) if result.num_sampled else None
        streamed = self._streamed.sent_of(plan)
        for item in plan.scheduled:
            if not item.sample:
                continue
            count = next(counts) if counts is not None else 1
            tokens = [(next(sampled), next(logprobs)) for _ in range(count)]
            request = self.table.get(item.sequence_id)
            if request is None:
                continue  # it finished or was aborted after this step was planned
            num_streamed = streamed.get(item.sequence_id, 0)  # as the forwards sampled them
            if item.draft_token_ids:
                self.counters.num_draft_tokens += len(item.draft_token_ids)
                self.counters.num_accepted_tokens += count - 1
                verified(request, item.start, item.num_tokens, count - 1)
            updates += self._sampled(request, tokens[num_streamed:],
                                     item.num_steps - num_streamed, now)
        for pooled in result.embeddings:  # embedding requests whose prompt was computed
            if (request := self.table.get(pooled.sequence_id)) is not None:
                request.trace.first_token_time = request.trace.finish_time = now
                self._remove(request)
                self._finish(request, FinishReason.STOP)
                self._embedded.append(Embedded(request, pooled.vector))
        return updates

    def stream(self, plan: StepPlan, progress: StepProgress,
               now: float = 0.0) -> list[RequestTokens]:
        """A forward's tokens of the plan awaited (several forwards), before its result:
        appended and sent on now (streamed_forwards.py), after the updates waiting to go (a
        first token from a prefill engine's: the detokenizer takes a completion's in order)."""
        updates = self.take_ended_updates()
        for item, token, logprobs in self._streamed.take(plan, progress):
            if (request := self.table.get(item.sequence_id)) is not None:
                updates += self._sampled(request, [(token, logprobs)], 1, now)
        return updates

    def _sampled(self, request: Request, tokens: list[tuple[int, TokenLogprobs | None]],
                 num_steps: int, now: float) -> list[RequestTokens]:  # of its planned steps
        request.num_pending_tokens -= num_steps
        if request.trace.first_token_time is None:
            request.trace.first_token_time = now
        self._append_tokens(request, tokens, now)
        return [token_update(request, self.num_steps)]

    def _append_tokens(self, request: Request,
                       tokens: list[tuple[int, TokenLogprobs | None]], now: float) -> None:
        """Add a step's tokens to the request, in order, until one ends it (the rest of a
        verified run after a stop token, or past max_tokens, is dropped)."""
        for token_id, token_logprobs in tokens:
            request.output_token_ids.append(token_id)
            self.counters.num_generated_tokens += 1
            if token_logprobs is not None:
                request.sent.logprobs.append(token_logprobs)
            reason = stop_reason(request, token_id, self.config.eos_token_ids)
            if reason is not FinishReason.NONE:
                self._remove(request)
                self._finish(request, reason)
                request.trace.finish_time = now
                return
        self.blocks.cache_full_blocks(request)

    def _first_token(self, request: Request, token_id: int, logprobs: TokenLogprobs | None,
                     now: float) -> None:
        """A request prefilled elsewhere brought its first token: it goes out with the next
        update (disaggregation/transitions.py)."""
        self._append_tokens(request, [(token_id, logprobs)], now)
        self._ended_updates.append(token_update(request, self.num_steps))

    def _end(self, requests: list[Request], reason: FinishReason, error: str = "",
             resumable: bool = False) -> list[RequestTokens]:
        """End these requests wherever they are; returns their last updates."""
        updates = []
        for request in requests:
            self._remove(request)
            self._finish(request, reason)
            if request.embeds:
                self._embedded.append(Embedded(request, error=error or "aborted"))
            else:
                updates.extend(end_updates(request, self.num_steps, error, resumable))
        return updates

    def _remove(self, request: Request) -> None:
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.REMOTE:
            self.remote.cancel(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._drop(request, reason)
        self.counters.num_finished += 1
        self._finished.append(request)

    def _drop(self, request: Request, reason: FinishReason) -> None:
        """Forget a request (already out of the queues): blocks, ids, the executor's copy."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.blocks.release(request)
        self.table.remove(request)
        self.planner.forget(request)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Reference counts equal the owners (requests + cache); no block is lost. For tests."""
        self.kv.check(r.block_table for r in self.table)
        assert len(self.running) + len(self.waiting) + len(self.remote) == len(self.table)

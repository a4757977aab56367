"""Continuous batching over paged KV blocks: the scheduler's pure core.

There is no prefill phase and no decode phase. Each request has tokens (prompt + sampled
output) and computed tokens (whose KV is in the cache); every step, the scheduler lets computed
tokens catch up with tokens under a token budget. Running requests go first, in arrival order,
so decodes never stall behind a long prompt; then waiting requests are admitted, and a prompt
longer than the remaining budget is split over several steps (chunked prefill). When a running
request needs a block and none is free, the newest running request is preempted: its blocks are
freed and it returns to the front of the waiting queue, to be recomputed later.

No I/O, no clock, no torch: `schedule()` builds a `StepPlan`, `update()` applies the executor's
`StepResult` and returns the token updates for the detokenizer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from bus.messages import (
    FinishReason,
    NewRequestData,
    RequestTokens,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepResult,
)
from services.scheduler.block_allocator import BlockAllocator
from services.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


class AdmissionError(ValueError):
    """A request that can never run here (too long for the context or the whole cache)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.max_batch_size = 0
        # Requests that ended outside update() (aborts), reported with the next update.
        self._ended_updates: list[RequestTokens] = []
        # Requests the executor must forget, sent with the next plan.
        self._forget_ids: list[str] = []
        self._preempted_ids: list[str] = []
        # How much of each running request's block table the executor already has.
        self._num_blocks_sent: dict[str, int] = {}

    # ------------------------------------------------------------------ admission

    def add_request(self, request_id: str, reply_subject: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float = 0.0) -> Request:
        """Queue a request, or raise AdmissionError if it can never be served."""
        config = self.config
        num_prompt = len(prompt_token_ids)
        if request_id in self.requests:
            raise AdmissionError(f"duplicate request id {request_id}")
        if num_prompt == 0:
            raise AdmissionError("the prompt is empty", param="prompt")
        if num_prompt >= config.max_model_len:
            raise AdmissionError(
                f"this model's maximum context length is {config.max_model_len} tokens, "
                f"but the prompt has {num_prompt} tokens", param="messages")
        room = config.max_model_len - num_prompt
        if params.max_tokens > room:
            raise AdmissionError(
                f"this model's maximum context length is {config.max_model_len} tokens; "
                f"the prompt has {num_prompt} tokens, so max_tokens can be at most {room} "
                f"(got {params.max_tokens})", param="max_tokens")
        max_tokens = params.max_tokens or room
        num_cache_tokens = self.allocator.num_usable * config.block_size
        if num_prompt + max_tokens > num_cache_tokens:
            if params.max_tokens:
                raise AdmissionError(
                    f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the "
                    f"KV cache of this server ({num_cache_tokens} tokens)", param="max_tokens")
            max_tokens = num_cache_tokens - num_prompt
            if max_tokens < 1:
                raise AdmissionError(
                    f"the prompt ({num_prompt} tokens) does not fit the KV cache of this "
                    f"server ({num_cache_tokens} tokens)", param="messages")
        request = Request(request_id, reply_subject, list(prompt_token_ids), params,
                          max_tokens=max_tokens, arrival_time=arrival_time)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """End a request wherever it is; its blocks are freed at once."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self._finish(request, FinishReason.ABORT)
        self._ended_updates.append(self._token_update(request))
        return True

    def fail_all(self, error: str) -> list[RequestTokens]:
        """End every request with an error (the executor is gone); returns their updates."""
        updates = []
        for request in list(self.running) + list(self.waiting):
            self._finish(request, FinishReason.ERROR)
            updates.append(self._token_update(request, error=error))
        self.running.clear()
        self.waiting.clear()
        self._forget_ids.clear()
        self._preempted_ids.clear()
        return updates

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_ended_updates(self) -> list[RequestTokens]:
        updates, self._ended_updates = self._ended_updates, []
        return updates

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> StepPlan:
        """Choose this step's work and reserve its blocks."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # Running requests first, oldest first; the newest are preempted when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._reserve_blocks(request, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself; everything after it is gone too

        # Then waiting requests, in order, while budget, sequence slots and blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_blocks(request, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        plan = StepPlan(step_id=self.num_steps, finished_request_ids=self._forget_ids,
                        preempted_request_ids=self._preempted_ids)
        self._forget_ids, self._preempted_ids = [], []
        for request, num_new in scheduled:
            if not request.known_to_executor:
                request.known_to_executor = True
                plan.new_requests.append(NewRequestData(
                    request.request_id, request.prompt_token_ids, request.params))
            end = request.num_computed_tokens + num_new
            num_sent = self._num_blocks_sent.pop(request.request_id, 0)
            plan.scheduled.append(ScheduledRequest(
                request_id=request.request_id, start=request.num_computed_tokens,
                num_tokens=num_new, new_block_ids=request.block_table[num_sent:],
                sample=end == request.num_tokens))
            self._num_blocks_sent[request.request_id] = len(request.block_table)
        self.num_steps += 1
        self.max_batch_size = max(self.max_batch_size, len(plan.scheduled))
        return plan

    def _reserve_blocks(self, request: Request, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens` tokens, if enough blocks are free."""
        block_size = self.config.block_size
        num_needed = -(-num_tokens // block_size) - len(request.block_table)
        if num_needed <= 0:
            return True
        if not self.allocator.can_allocate(num_needed):
            return False
        request.block_table.extend(self.allocator.allocate(num_needed))
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue."""
        self.running.remove(request)
        self.allocator.free(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._num_blocks_sent.pop(request.request_id, None)
        if request.known_to_executor:
            self._preempted_ids.append(request.request_id)
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestTokens]:
        """Apply a step's sampled tokens; returns the token updates for the detokenizer."""
        updates = self.take_ended_updates()
        sampled = iter(result.sampled_token_ids)
        for item in plan.scheduled:
            request = self.requests.get(item.request_id)
            token_id = next(sampled) if item.sample else None
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.num_computed_tokens = item.start + item.num_tokens
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            reason = self._stop_reason(request, token_id)
            if reason is not FinishReason.NONE:
                self.running.remove(request)
                self._finish(request, reason)
            updates.append(self._token_update(request))
        return updates

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason:
        params = request.params
        if not params.ignore_eos and token_id in self.config.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.max_tokens:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.allocator.free(request.block_table)
        request.block_table = []
        self._num_blocks_sent.pop(request.request_id, None)
        del self.requests[request.request_id]
        if request.known_to_executor:
            self._forget_ids.append(request.request_id)
        self.num_finished += 1

    def _token_update(self, request: Request, error: str = "") -> RequestTokens:
        first = request.num_sent_tokens == 0
        new_token_ids = request.output_token_ids[request.num_sent_tokens:]
        request.num_sent_tokens = len(request.output_token_ids)
        return RequestTokens(
            request_id=request.request_id, reply_subject=request.reply_subject,
            new_token_ids=new_token_ids, finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            stop=request.params.stop if first else [],
            include_stop_str_in_output=request.params.include_stop_str_in_output,
            error=error, step_id=self.num_steps)

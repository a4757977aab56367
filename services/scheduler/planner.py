# Over 300 lines: one plan's phases share its budgets, queues and blocks (time: step_time.py,
# drafts: speculation.py, decode steps: multi_step.py, remote prefills: disaggregation/).
"""One step's plan: which requests compute how many tokens, under the token budget, the step's
time target and the free blocks (the model is scheduler.py's docstring).

Running requests go first, oldest first, each through the same phases: its tokens within the
step's time (a prompt chunk beside decodes, step_time.py), its drafts (speculation.py), its
decode steps (multi_step.py), then its blocks, for which the newest running requests give way
(preemption). On a split model, while other work is there to overlap with the plan in flight,
only the requests whose next input is known (disjoint plans, which its shards compute at once;
with none, the decodes are planned ahead as on a whole model, which saves a round trip). Then
waiting requests, in order, while the budget, the sequence slots and the blocks allow; a long
uncached prompt may go to a prefill engine instead (disaggregation/transitions.py).

The planner also keeps what the next plan tells the executor besides its work: sequences to
forget and preempted ones. It works on the scheduler's queues, table and blocks (shared, not
copied). Pure: no bus, no clock (`now` only stamps requests for traces).
"""

from __future__ import annotations

from collections import deque

from llmbus.bus.messages import NewRequestData, ScheduledRequest, StepPlan
from llmbus.services.scheduler.admission import params_for
from llmbus.services.scheduler.block_tables import BlockTables
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.disaggregation.transitions import RemotePrefilling
from llmbus.services.scheduler.multi_step import decode_steps, max_decode_steps, multi_step_decode
from llmbus.services.scheduler.request import Request, RequestStatus, Trace
from llmbus.services.scheduler.request_table import Counters, RequestTable
from llmbus.services.scheduler.speculation import drafts_for, waits_for_drafts
from llmbus.services.scheduler.step_time import StepBudget, StepShape, StepTimeModel

Scheduled = list[tuple[Request, int, int]]  # (request, tokens, decode steps), in plan order


class StepPlanner:
    def __init__(self, config: SchedulerConfig, step_time: StepTimeModel, blocks: BlockTables,
                 waiting: deque[Request], running: list[Request], table: RequestTable,
                 counters: Counters, remote: RemotePrefilling) -> None:
        self.config, self.step_time, self.blocks = config, step_time, blocks
        self.waiting, self.running, self.table = waiting, running, table
        self.counters, self.remote = counters, remote
        self.forget_ids: list[str] = []  # the executor drops these before the next step
        self.preempted_ids: list[str] = []

    def plan(self, step_id: int, now: float) -> StepPlan:
        """Choose this step's work, reserve its blocks, and advance computed tokens."""
        for parent in [r for r in self.running if r.is_parent
                       and r.num_computed_tokens >= r.target_tokens]:
            self._fork(parent)
        scheduled: Scheduled = []
        step = StepBudget(self.step_time, self._decode_shape(), self.config.max_step_seconds)
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, step,
                                        self.config.disjoint_plans and self._independent_work())
        self._schedule_waiting(budget, scheduled, step, now)
        plan = StepPlan(step_id=step_id, finished_sequence_ids=self.forget_ids,
                        preempted_sequence_ids=self.preempted_ids,
                        copy_blocks=self.blocks.take_copies(),
                        closed_transfers=self.remote.tries.take_closed())
        self.forget_ids, self.preempted_ids = [], []
        for request, num_new, num_steps in scheduled:
            if request.trace.first_scheduled_time is None:
                request.trace.first_scheduled_time = now
            if request.num_computed_tokens < request.num_prompt_tokens:
                request.trace.prefill_chunks.append((now, num_new))
            plan.scheduled.append(self._plan_item(request, num_new, plan, num_steps))
        self.counters.max_batch_size = max(self.counters.max_batch_size, len(plan.scheduled))
        return plan

    def unplan_empty(self, plan: StepPlan) -> None:
        """Take back a plan with nothing scheduled: its bookkeeping rides the next plan."""
        assert not plan.scheduled
        self.forget_ids[:0] = plan.finished_sequence_ids
        self.preempted_ids[:0] = plan.preempted_sequence_ids
        self.blocks.copies[:0] = plan.copy_blocks
        self.remote.tries.closed[:0] = plan.closed_transfers

    @property
    def has_bookkeeping(self) -> bool:
        """Ended requests the executor still holds: worth a plan of their own when idle."""
        return bool(self.forget_ids or self.preempted_ids or self.remote.tries.closed)

    def forget(self, request: Request) -> None:
        """The request is gone from here: the executor drops its copy, if it has one."""
        if request.sent.to_executor:
            self.forget_ids.append(request.sequence_id)

    def _decode_shape(self) -> StepShape:
        """The running requests that decode a token this step (what prompt chunks must not
        stall), as the step-time model sees them."""
        shape = StepShape()
        for r in self.running:
            if (r.target_tokens - r.num_computed_tokens == 1 and not r.is_parent
                    and not r.spec.draft_token_ids
                    and len(r.output_token_ids) + r.num_pending_tokens < r.max_tokens):
                shape.add(r.num_computed_tokens, 1)
        return shape

    # ------------------------------------------------------------------ running requests

    def _independent_work(self) -> bool:
        """Work that needs no token a plan in flight samples: a prompt that waits, or a
        running request with tokens to compute and none on the way."""
        return bool(self.waiting) or any(
            not r.num_pending_tokens and r.num_computed_tokens < r.target_tokens
            for r in self.running)

    def _schedule_running(self, budget: int, scheduled: Scheduled, step: StepBudget,
                          skip_pending: bool = False) -> int:
        """Running requests first, oldest first; the newest give way when blocks run out.
        `skip_pending`: not those whose next input a plan in flight samples. Appends to
        `scheduled`; returns the token budget left."""
        most_steps = self._most_decode_steps(step)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            index += 1
            if request.num_pending_tokens and skip_pending:
                continue  # its input is sampled in a plan in flight: the next plan's
            prompt = _in_prompt(request)
            num_new = self._tokens_in_time(request, budget, step, prompt)
            drafts = self._drafts(request, budget) if num_new else None
            if drafts is None:  # nothing to compute, or it waits to speculate from its token
                continue
            if prompt:
                step.take(request.num_computed_tokens, num_new)
            elif drafts:
                step.add_drafts(request.num_computed_tokens, len(drafts))
            num_new += len(drafts)
            num_steps = self._decode_steps(request, num_new, budget, most_steps)
            if not self._make_room(request, num_new + num_steps - 1):
                return budget  # it preempted itself; everything after it is gone too
            request.spec.draft_token_ids = drafts
            scheduled.append((request, num_new, num_steps))
            budget -= num_new + num_steps - 1
        return budget

    def _tokens_in_time(self, request: Request, budget: int, step: StepBudget,
                        prompt: bool) -> int:
        """The time budget: tokens the request computes this step (0: none); of its `prompt`,
        only a chunk that keeps the step within its time target beside the decodes."""
        num_new = self._num_new_tokens(request, budget)
        if prompt:
            return step.prompt_chunk(request.num_computed_tokens, num_new, request.embeds)
        return num_new

    def _drafts(self, request: Request, budget: int) -> list[int] | None:
        """The request's drafts ([] if none); None: it skips this step, to speculate from its
        token on the way once that is known (speculation.py)."""
        if self.config.num_speculative_tokens == 0 or request.embeds:
            return []
        drafts = drafts_for(request, self.config, budget)
        if not drafts and waits_for_drafts(request, self.config):
            return None
        return drafts

    def _most_decode_steps(self, step: StepBudget) -> int:
        """Decode steps a request may take in this plan (multi_step.py): 1 unless the batch is
        small and nothing waits, and the step-time model knows these contexts' cost."""
        if not multi_step_decode(self.config, len(self.running), len(self.waiting)):
            return 1
        most_steps = max_decode_steps(self.config, self.step_time.predict(step.shape))
        if most_steps > 1 and not self.step_time.knows_context(
                max((r.num_computed_tokens for r in self.running), default=0)):
            return 1  # one forward first, to learn what these contexts cost
        return most_steps

    def _decode_steps(self, request: Request, num_new: int, budget: int, most_steps: int) -> int:
        """Steps this request takes in the plan: further ones only with blocks to spare."""
        if most_steps == 1 or request.embeds:
            return 1
        num_steps = decode_steps(request, self.config, budget, most_steps)
        if num_steps > 1 and not self.blocks.reserve(request, num_new + num_steps - 1):
            return 1  # the further steps are not worth preempting anyone for
        return num_steps

    def _make_room(self, request: Request, num_new: int) -> bool:
        """Reserve the request's blocks, preempting the newest running requests until they
        fit. False: the request itself was preempted."""
        while not self.blocks.reserve(request, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue."""
        self.running.remove(request)
        self.blocks.release(request)
        request.status = RequestStatus.WAITING
        request.trace.num_preemptions += 1
        self.counters.num_preemptions += 1
        if request.sent.to_executor:
            self.preempted_ids.append(request.sequence_id)
        self.waiting.appendleft(request)

    def _fork(self, parent: Request) -> None:
        """Replace a prefilled parent by its n completions, sharing its blocks."""
        position = self.running.index(parent)
        children = []
        base = parent.sequence_id.removesuffix("#prompt")  # the attempt's, as add_request's
        for i in range(parent.num_forks):
            child = Request(
                f"{base}#{i}", parent.request_id, i, parent.reply_subject,
                parent.prompt_token_ids, params_for(parent.params, i),
                max_tokens=parent.max_tokens,
                attempt=parent.attempt, num_computed_tokens=parent.num_computed_tokens,
                status=RequestStatus.RUNNING, trace=Trace(
                    traceparent=parent.trace.traceparent, arrival_time=parent.trace.arrival_time,
                    first_scheduled_time=parent.trace.first_scheduled_time,
                    prefill_chunks=list(parent.trace.prefill_chunks)))
            self.blocks.share(parent, child)
            children.append(child)
        self.running[position:position + 1] = children
        self.table.fork(parent, children)
        self.blocks.release(parent)
        self.forget(parent)

    # ------------------------------------------------------------------ waiting requests

    def _schedule_waiting(self, budget: int, scheduled: Scheduled, step: StepBudget,
                          now: float) -> None:
        """Then waiting requests, in order, while budget, sequence slots and blocks allow."""
        num_seqs = sum(r.num_forks for r in self.running) + len(self.remote)
        while self.waiting and budget > 0 and self._adapter_fits_first():
            request = self.waiting[0]
            if (num_seqs + request.num_forks > self.config.max_num_seqs
                    or request.spec.draft_token_ids):  # preempted while its drafts are verified
                break
            looked_up = self.blocks.kv.tree is not None and request.num_computed_tokens == 0
            num_matched = self.blocks.match_prefix(request)
            if self.remote.prefill_elsewhere(request, step, now):
                self.waiting.popleft()
                num_seqs += request.num_forks
                if looked_up:
                    self._count_prefix_hits(request.num_prompt_tokens, num_matched)
                    request.trace.num_cached_tokens = min(num_matched * self.config.block_size,
                                                          request.num_prompt_tokens)
                continue
            num_new = step.prompt_chunk(request.num_computed_tokens,
                                        self._num_new_tokens(request, budget), request.embeds)
            if self.config.whole_prompts and num_new < request.target_tokens:
                num_new = 0  # an encoder's prompt waits for a step with room for all of it
            if num_new == 0 or not self.blocks.reserve(request, num_new):
                self.blocks.release(request)  # give back the matched prefix
                break
            step.take(request.num_computed_tokens, num_new)
            if looked_up:  # counted once, when admitted: a head that waits asks again
                self._count_prefix_hits(request.target_tokens, num_matched)
                request.trace.num_cached_tokens = min(num_matched * self.config.block_size,
                                                      request.num_prompt_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new, 1))
            budget -= num_new
            num_seqs += request.num_forks

    def _adapter_fits_first(self) -> bool:
        """Bring to the head of the queue the first waiting request whose LoRA adapter fits
        beside the running ones (the executor's slots: a step mixes at most `max_adapters`);
        False if none does. The others keep their order."""
        running = {r.params.adapter for r in self.running} - {""}
        for request in self.waiting:
            adapter = request.params.adapter
            if not adapter or adapter in running or len(running) < self.config.max_adapters:
                if request is not self.waiting[0]:
                    self.waiting.remove(request)
                    self.waiting.appendleft(request)
                return True
        return False

    def _count_prefix_hits(self, num_query_tokens: int, num_matched_blocks: int) -> None:
        self.counters.num_prefix_query_tokens += num_query_tokens
        self.counters.num_prefix_hit_tokens += num_matched_blocks * self.config.block_size

    # ------------------------------------------------------------------ the plan's items

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if len(request.output_token_ids) + request.num_pending_tokens >= request.max_tokens:
            return 0  # its last token is on the way: it finishes when the result arrives
        if request.spec.draft_token_ids:
            return 0  # how far it got is known once its drafts are verified
        return min(request.target_tokens - request.num_computed_tokens, budget)

    def _plan_item(self, request: Request, num_new: int, plan: StepPlan,
                   num_steps: int = 1) -> ScheduledRequest:
        if not request.sent.to_executor:
            request.sent.to_executor = True
            plan.new_requests.append(NewRequestData(  # a resumed request's output with it
                request.sequence_id, request.prompt_token_ids, request.params,
                request.trace.traceparent, output_token_ids=list(request.output_token_ids),
                kv_destination=request.remote.kv_destination))
        start = request.num_computed_tokens
        end = start + num_new
        drafts = request.spec.draft_token_ids
        sample = (not request.is_parent and not request.embeds
                  and end - len(drafts) == request.num_tokens)
        item = ScheduledRequest(
            sequence_id=request.sequence_id, start=start, num_tokens=num_new,
            new_block_ids=request.block_table[request.sent.num_blocks:], sample=sample,
            draft_token_ids=list(drafts), num_steps=num_steps)
        request.sent.num_blocks = len(request.block_table)
        request.num_computed_tokens = end + num_steps - 1  # each further step computes one
        request.num_pending_tokens += sample * num_steps
        self.blocks.cache_full_blocks(request)
        return item


def _in_prompt(request: Request) -> bool:
    """More than one token to compute: a chunk of its prompt, not a decode."""
    return request.target_tokens - request.num_computed_tokens > 1

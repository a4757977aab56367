"""What the scheduler's tests share: schedulers of a few shapes, a fake executor that keeps real KV
contents, the loop that drives steps as the engine loop does, random traces, and a decode
engine with a prefill engine beside it. Pure: no bus, no model, no clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hypothesis import strategies as st

from llmbus.bus.messages import (
    Heartbeat,
    RequestTokens,
    SamplingParams,
    ScheduledRequest,
    StepPlan,
    StepResult,
)
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.disaggregation.rule import DisaggregationRule
from llmbus.services.scheduler.request import Request
from llmbus.services.scheduler.scheduler import Scheduler
from llmbus.services.scheduler.step_time import StepShape, StepTimeModel

EOS = 2
BLOCK = 4  # make_speculative's block size, which FakeExecutor and replay_trace assume
PREFILL_BLOCK = 16  # the prefill engines' heartbeats


def make(num_blocks: int = 9, block_size: int = 4, max_num_batched_tokens: int = 64,
         max_num_seqs: int = 8, max_model_len: int = 64, prefix_caching: bool = False,
         ) -> Scheduler:
    """One token a step (multi-step decoding: test_scheduler_multi_step.py)."""
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                     max_model_len=max_model_len, eos_token_ids=(EOS,),
                                     max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     enable_prefix_caching=prefix_caching, decode_steps=1))


def add(s: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 4, n: int = 1,
        first_token: int = 10, **params):
    s.add_request(request_id, "api.x", list(range(first_token, first_token + num_prompt)),
                  SamplingParams(max_tokens=max_tokens, **params), n=n)
    return s.table.get(request_id)


def run_step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    num_sampled = sum(item.sample for item in plan.scheduled)
    updates = s.update(plan, StepResult(step_id=plan.step_id,
                                        sampled_token_ids=[token] * num_sampled))
    return plan, updates


def make_speculative(k: int = 4, num_blocks: int = 32, prefix_caching: bool = True, n_min: int = 2,
         **limits) -> Scheduler:  # also takes decode_steps (multi-step decoding; 1 if not)
    limits.setdefault("decode_steps", 1)
    return Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=BLOCK, max_model_len=limits.pop("max_model_len", 96),
        eos_token_ids=(EOS,), enable_prefix_caching=prefix_caching, num_speculative_tokens=k,
        spec_ngram_min=n_min, spec_ngram_max=4, **limits))


class FakeExecutor:
    """Holds each request's tokens and block table as the executor does, and the KV cache as
    (block, offset) -> token id. `next_token(sequence_id, tokens)` is the model: what follows."""

    def __init__(self, next_token) -> None:
        self.next_token = next_token
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.kv: dict[tuple[int, int], int] = {}

    def run(self, plan: StepPlan) -> StepResult:
        self._bookkeeping(plan)
        sampled, counts = [], []
        for item in plan.scheduled:
            tokens, table = self.tokens[item.sequence_id], self.tables[item.sequence_id]
            table.extend(item.new_block_ids)
            known_end = item.start + item.num_tokens - len(item.draft_token_ids)
            end = item.start + item.num_tokens + item.num_steps - 1  # multi-step: one a step
            assert known_end <= len(tokens) and len(table) * BLOCK >= end
            for position in range(item.start):  # what this query attends to
                slot = (table[position // BLOCK], position % BLOCK)
                assert self.kv.get(slot) == tokens[position], (item.sequence_id, position)
            query = tokens[item.start:known_end] + item.draft_token_ids
            for i, token in enumerate(query):
                position = item.start + i
                self.kv[table[position // BLOCK], position % BLOCK] = token
            if item.sample:
                assert known_end == len(tokens)
                new = self._verify(item.sequence_id, tokens, item.draft_token_ids)
                tokens.extend(new)
                for _ in range(item.num_steps - 1):  # each further step feeds the last token
                    position = len(tokens) - 1
                    self.kv[table[position // BLOCK], position % BLOCK] = tokens[-1]
                    new.append(self.next_token(item.sequence_id, tokens))
                    tokens.append(new[-1])
                sampled += new
                counts.append(len(new))
        return StepResult(step_id=plan.step_id, sampled_token_ids=sampled, num_sampled=counts)

    def _verify(self, sequence_id: str, tokens: list[int], drafts: list[int]) -> list[int]:
        """The drafts the model agrees with (it would say the same), then its next token."""
        new = []
        for draft in drafts:
            if self.next_token(sequence_id, tokens + new) != draft:
                break
            new.append(draft)
        return new + [self.next_token(sequence_id, tokens + new)]

    def _bookkeeping(self, plan: StepPlan) -> None:
        for sequence_id in plan.finished_sequence_ids:
            self.tokens.pop(sequence_id, None)
            self.tables.pop(sequence_id, None)
        for sequence_id in plan.preempted_sequence_ids:
            self.tables[sequence_id] = []
        for new in plan.new_requests:
            self.tokens[new.sequence_id] = list(new.prompt_token_ids)
            self.tables[new.sequence_id] = []
        for copy in plan.copy_blocks:
            for offset in range(BLOCK):
                if (copy.src, offset) in self.kv:
                    self.kv[copy.dst, offset] = self.kv[copy.src, offset]


def cycle(period: list[int]):
    """A model that repeats `period` forever after the prompt: drafts from the output match."""
    return lambda _, tokens: period[len(tokens) % len(period)]


def drive(s: Scheduler, step: Callable[[StepPlan], StepResult], depth: int = 2,
          max_steps: int = 500, in_flight: deque | None = None,
          ) -> tuple[list[StepPlan], list[RequestTokens]]:
    """Plan (up to `depth` ahead, as the engine loop does) and run steps until every request
    finished; the plans sent and the updates for the detokenizer."""
    in_flight = deque() if in_flight is None else in_flight
    plans, updates = [], []
    for _ in range(max_steps):
        if not s.has_work and not in_flight:
            return plans, updates
        if len(in_flight) < depth and s.has_work:
            plan = s.schedule()
            if plan.scheduled or not in_flight:
                in_flight.append(plan)
                plans.append(plan)
                continue
            s.unschedule_empty(plan)
        plan = in_flight.popleft()
        updates += s.update(plan, step(plan))
        s.check_invariants()
    raise AssertionError("requests did not finish")


def run(s: Scheduler, executor: FakeExecutor, **options) -> list[StepPlan]:
    return drive(s, executor.run, **options)[0]


operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 3), st.integers(0, 12),
              st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step")),
    st.tuples(st.just("result")),
), max_size=60)


def arrive_or_abort(s: Scheduler, op: tuple, ids: list[str]) -> bool:
    """Apply a random trace's ("add", num_prompt, n, max_tokens, family) or ("abort", k) op,
    naming arrivals r0, r1, ... in `ids`; False for any other op. A prompt's first half is its
    family's token, so families share cached prefixes."""
    if op[0] == "add":
        _, num_prompt, n, max_tokens, family = op
        request_id = f"r{len(ids)}"
        try:
            s.add_request(request_id, "api", [family] * (num_prompt // 2)
                          + list(range(num_prompt - num_prompt // 2)),
                          SamplingParams(max_tokens=max_tokens), n=n)
            ids.append(request_id)
        except ValueError:
            pass  # refused up front: it could never fit
        return True
    if op[0] == "abort":
        if ids:
            s.abort_request(ids[op[1] % len(ids)])
        return True
    return False


def replay_trace(s: Scheduler, executor: FakeExecutor, ops) -> None:
    """Apply `operations` (arrivals, aborts, plans up to 2 ahead, results) with the invariants
    checked after each (disjoint plans, a split engine's: a plan planned ahead reads tokens
    the plan in flight samples for all its requests or for none), then finish everything:
    nothing may be left, and what stays cached must hold the tokens it is keyed by."""
    in_flight: deque = deque()
    ids = []
    for op in ops:
        if arrive_or_abort(s, op, ids):
            pass  # an arrival or an abort, applied
        elif op[0] == "step" and len(in_flight) < 2:
            plan = s.schedule()
            if s.config.disjoint_plans and in_flight:  # a split engine's: work that overlaps
                sampling = {i.sequence_id for i in in_flight[-1].scheduled if i.sample}
                ahead = {i.sequence_id for i in plan.scheduled}
                assert ahead <= sampling or not ahead & sampling, plan
            if plan.scheduled or not in_flight:
                in_flight.append(plan)
            else:
                s.unschedule_empty(plan)
        elif op[0] == "result" and in_flight:
            plan = in_flight.popleft()
            s.update(plan, executor.run(plan))
        s.check_invariants()
    run(s, executor, max_steps=3000, in_flight=in_flight)
    assert s.table.sequences == {} and s.table.families == {}
    if s.kv.tree is not None:
        for node in s.kv.tree.nodes_by_block.values():
            assert [executor.kv.get((node.block_id, i)) for i in range(BLOCK)] == list(node.key)


def prefill_heartbeat(queued: int = 0, free_blocks: int = 1000, instance: str = "p1") -> Heartbeat:
    return Heartbeat(service="scheduler", instance_id=instance, engine_id=f"prefill-{instance}",
                     role="prefill", num_queued_tokens=queued, num_free_blocks=free_blocks,
                     block_size=PREFILL_BLOCK)


def linear_model(per_token: float = 1e-3, per_row: float = 2e-3,
                 base: float = 5e-3) -> StepTimeModel:
    """A step-time model fitted on steps of exactly base + rows·per_row + tokens·per_token
    (no attention cost), so every prediction below is that formula."""
    model = StepTimeModel()
    for rows, tokens in ((1, 256), (1, 128), (4, 4), (8, 8), (2, 64), (16, 16)):
        plan = StepPlan(step_id=0)
        plan.scheduled = [ScheduledRequest(sequence_id=str(i), start=0,
                                           num_tokens=tokens - rows + 1 if i == 0 else 1)
                          for i in range(rows)]
        shape = StepShape.of(plan)
        model.observe(plan, base + per_row * shape.rows + per_token * shape.tokens)
    return model


def decode_engine(num_blocks: int = 40, block_size: int = 4) -> Scheduler:
    s = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                  max_model_len=128, eos_token_ids=(2,), decode_steps=1,
                                  disaggregation=DisaggregationRule(mode="always")))
    s.remote.prefill_engines = [Heartbeat(service="scheduler", instance_id="p1", engine_id="P",
                                   role="prefill", num_free_blocks=1000, block_size=block_size)]
    return s


def add_prompt(s: Scheduler, request_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
    s.add_request(request_id, "api.x", prompt, SamplingParams(max_tokens=max_tokens))
    return s.table.get(request_id)

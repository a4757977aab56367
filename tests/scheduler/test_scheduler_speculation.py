"""Speculative decoding in the scheduler, against a fake executor that keeps real KV contents:
each step checks that every position a request attends to holds its true token (never a
rejected draft, a stale cached block or an uncopied shared one), then writes its query there."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.bus.messages import (
    FinishReason,
    RequestTokens,
    SamplingParams,
    StepPlan,
    StepResult,
    StructuredOutput,
)
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.scheduler import Scheduler

EOS = 2
BLOCK = 4


def make(k: int = 4, num_blocks: int = 32, prefix_caching: bool = True, n_min: int = 2,
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


def test_a_repeating_output_is_verified_several_tokens_a_step():
    s = make(k=4)
    s.add_request("r", "api", [9, 8, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    executor = FakeExecutor(cycle([5, 6, 7, 1]))
    plans = run(s, executor)
    assert executor.tokens["r"][3:] == [1, 5, 6, 7] * 10
    drafted = [i for p in plans for i in p.scheduled if i.draft_token_ids]
    counters = s.counters
    assert drafted and counters.num_accepted_tokens == counters.num_draft_tokens  # exact cycle
    assert len(plans) < 40 / 2  # several tokens per step once the cycle shows
    assert max(len(i.draft_token_ids) for i in drafted) == 4


def test_a_constrained_request_gets_no_drafts():
    """Its grammar matcher in the executor only goes forward (executor/constraints.py)."""
    s = make(k=4)
    s.add_request("r", "api", [9, 8, 7], SamplingParams(
        max_tokens=40, ignore_eos=True, structured=StructuredOutput(kind="json_object")))
    executor = FakeExecutor(cycle([5, 6, 7, 1]))
    plans = run(s, executor)
    assert executor.tokens["r"][3:] == [1, 5, 6, 7] * 10
    assert not any(i.draft_token_ids for p in plans for i in p.scheduled)


def test_the_output_with_drafts_is_the_output_without():
    def model(_, tokens):  # follows its last token, but slips every 9 positions
        return (tokens[-1] * 7 + (len(tokens) % 9 == 0)) % 11 + 3

    outputs = []
    for k in (0, 3):
        s = make(k=k, n_min=1)
        s.add_request("r", "api", [3, 4, 5, 3, 4], SamplingParams(max_tokens=60, ignore_eos=True))
        _, updates = drive(s, FakeExecutor(model).run)
        outputs.append([t for u in updates for t in u.new_token_ids])
        if k:
            counters = s.counters
            assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # some wrong
    assert outputs[0] == outputs[1] and len(outputs[0]) == 60


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    s = make(k=4)
    s.add_request("r", "api", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=30))
    model = cycle([5, 6, 7])  # after the prompt: 7, 5, 6, 7, ...
    executor = FakeExecutor(lambda rid, tokens: EOS if len(tokens) == 11 else model(rid, tokens))
    _, updates = drive(s, executor.run, depth=1)
    tokens = [t for u in updates for t in u.new_token_ids]
    assert tokens == [7, 5, 6, EOS] and updates[-1].finish_reason == FinishReason.STOP


def test_drafts_stop_at_max_tokens():
    s = make(k=8)
    s.add_request("r", "api", [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    plans = run(s, FakeExecutor(cycle([5, 6])))
    for plan in plans:
        for item in plan.scheduled:  # never more tokens than max_tokens allows
            assert len(item.draft_token_ids) <= 5 - 1
    assert s.counters.num_finished == 1


def test_misses_back_off_and_the_cache_holds_true_tokens():
    s = make(k=4)
    s.add_request("r", "api", [1, 2, 3, 4], SamplingParams(max_tokens=40, ignore_eos=True))
    # 1, 2, 3, then a new token: "1, 2, 3" always matches, what followed it never again
    executor = FakeExecutor(lambda _, tokens: (1, 2, 3, 10 + len(tokens))[len(tokens) % 4])
    plans = run(s, executor)
    drafted = [p.step_id for p in plans for i in p.scheduled if i.draft_token_ids]
    assert s.counters.num_accepted_tokens == 0 and 2 <= len(drafted) <= 3  # then 8, 16 tokens apart
    for node in s.kv.tree.nodes_by_block.values():
        assert [executor.kv[node.block_id, i] for i in range(BLOCK)] == list(node.key)


def test_penalties_and_min_tokens_speculate_too():
    """The executor applies them at every verified position (test_executor_speculative)."""
    for params in (SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.5),
                   SamplingParams(max_tokens=20, min_tokens=19)):
        s = make(k=4)
        s.add_request("r", "api", [5, 6, 5, 6, 5, 6], params)
        plans = run(s, FakeExecutor(cycle([5, 6])))
        assert any(i.draft_token_ids for p in plans for i in p.scheduled)


operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 3), st.integers(0, 12),
              st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step")),
    st.tuples(st.just("result")),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations, st.booleans(), st.integers(10, 24), st.integers(1, 4), st.integers(2, 5))
def test_random_traces_with_drafts_read_only_true_kv(ops, prefix_caching, num_blocks, k,
                                                    period):
    """Arrivals, aborts, preemption, forks, steps planned ahead, drafts partly right: every
    step attends to true tokens only, counts match owners, and everything finishes."""
    s = make(k=k, num_blocks=num_blocks, prefix_caching=prefix_caching, n_min=1,
             max_num_batched_tokens=16, max_num_seqs=6, max_model_len=48)

    def model(sequence_id, tokens):  # repeats with a period, but slips now and then
        value = tokens[-period] if len(tokens) > period else 5
        return EOS if (len(tokens) + len(sequence_id)) % 13 == 0 else (
            value if len(tokens) % 7 else value + 1)

    replay_trace(s, FakeExecutor(model), ops)


def replay_trace(s: Scheduler, executor: FakeExecutor, ops) -> None:
    """Apply `operations` (arrivals, aborts, plans up to 2 ahead, results) with the invariants
    checked after each, then finish everything: nothing may be left, and what stays cached
    must hold the tokens it is keyed by."""
    in_flight: deque = deque()
    ids = []
    for op in ops:
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
        elif op[0] == "abort" and ids:
            s.abort_request(ids[op[1] % len(ids)])
        elif op[0] == "step" and len(in_flight) < 2:
            plan = s.schedule()
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

"""Two plans at once on a split model's lead (plan_overlap.py): which plans may overlap, the
turns' order, and a lead that computes the next plan while its layer shard still holds the
one before, with the whole model's bits (a plan that needs the one before's token waits for
it: were it let, it would read a token not yet sampled and fail)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from llmbus.bus.messages import (
    NewRequestData,
    SamplingParams,
    ScheduledRequest,
    ShardSetup,
    ShardStep,
    StepPlan,
)
from llmbus.services.executor.layer_shard import LayerShard
from llmbus.services.executor.pipeline_lead import PipelinedForward
from llmbus.services.executor.plan_overlap import LeadTurns, independent
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.weights.layer_slice import LayerSlice, file_split
from tests.gguf_fixtures import TinySpec, write_tiny_llama

WAIT = 60.0  # seconds, for what another thread does at once on an idle machine


def item(sequence_id: str, start: int, num_tokens: int, sample: bool = True,
         blocks: tuple[int, ...] = (), num_steps: int = 1) -> ScheduledRequest:
    return ScheduledRequest(sequence_id=sequence_id, start=start, num_tokens=num_tokens,
                            new_block_ids=list(blocks), sample=sample, num_steps=num_steps)


def new(sequence_id: str, prompt: list[int]) -> NewRequestData:
    return NewRequestData(sequence_id=sequence_id, prompt_token_ids=prompt,
                          params=SamplingParams(temperature=0.0, logprobs=2))


def test_a_plan_overlaps_one_whose_samples_and_sequences_it_leaves_alone():
    earlier = StepPlan(step_id=1, scheduled=[item("a", 0, 8), item("b", 0, 4, sample=False)])
    assert independent(StepPlan(step_id=2, scheduled=[item("b", 4, 4), item("c", 0, 3)],
                                new_requests=[new("c", [1, 2, 3])]), earlier)
    assert independent(StepPlan(step_id=2), earlier)
    reads_a_sample = StepPlan(step_id=2, scheduled=[item("a", 8, 1)])
    forgets = StepPlan(step_id=2, finished_sequence_ids=["b"])
    preempts = StepPlan(step_id=2, preempted_sequence_ids=["b"])
    registers_again = StepPlan(step_id=2, new_requests=[new("b", [1])])
    several_forwards = StepPlan(step_id=2, scheduled=[item("c", 5, 1, num_steps=4)])
    for plan in (reads_a_sample, forgets, preempts, registers_again, several_forwards):
        assert not independent(plan, earlier)
    assert not independent(StepPlan(step_id=2, scheduled=[item("c", 0, 3)]),
                           StepPlan(step_id=1, scheduled=[item("a", 8, 1, num_steps=3)]))


def test_turns_go_in_ticket_order_and_a_second_turn_after_every_earlier_plan():
    turns, events, lock = LeadTurns(), [], threading.Lock()
    shard_done = threading.Event()

    def note(what: str) -> None:
        with lock:
            events.append(what)

    def run(ticket: int, plan: StepPlan, away: bool) -> None:
        with turns.plan(ticket, plan):
            note(f"{ticket} first")
            if away:
                turns.away(lambda: shard_done.wait(WAIT))
                note(f"{ticket} second")

    plans = [StepPlan(step_id=0, scheduled=[item("a", 0, 8)]),
             StepPlan(step_id=1, scheduled=[item("b", 0, 8)]),
             StepPlan(step_id=2, scheduled=[item("a", 8, 1)])]  # a's token from plan 0
    tickets = [turns.ticket() for _ in plans]
    with ThreadPoolExecutor(3) as threads:  # started last first: the order is the tickets'
        done = [threads.submit(run, tickets[i], plans[i], i < 2) for i in (2, 1, 0)]
        for _ in range(int(WAIT * 100)):
            if len(events) == 2:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.2)  # time enough for plan 2 to start, were it let
        assert events == ["0 first", "1 first"]  # plan 2 waits for plan 0's end
        shard_done.set()
        for future in done:
            future.result(timeout=WAIT)
    # Plan 2 may start beside plan 1 once plan 0 ended; plan 1's second turn follows plan 0's.
    assert events[:3] == ["0 first", "1 first", "0 second"]
    assert sorted(events[3:]) == ["1 second", "2 first"]


def _lead_and_shard(path) -> tuple[ModelRunner, LayerShard]:
    layers = file_split(path, 2)
    lead = ModelRunner(path, model_name="tiny", block_size=4, num_blocks=32, num_threads=1,
                       layers=LayerSlice(0, layers[0].stop, has_vocab=True))
    shard = LayerShard(path, lead.choice, LayerSlice(layers[1].start, layers[1].stop,
                                                     has_vocab=False), 1, 1 << 30)
    shard.setup(ShardSetup(lead.kv_cache.num_blocks, lead.block_size, lead.max_model_len))
    lead.copies_for_shards = []
    return lead, shard


PLANS = [  # 0 and 1 overlap (1 continues b's prompt); 2 reads a's token from 0
    StepPlan(step_id=0, new_requests=[new("a", [1, 5, 9, 13, 17, 21]), new("b", list(range(
        2, 40, 3)))], scheduled=[item("a", 0, 6, blocks=(3, 7)), item("b", 0, 5, False, (9, 2))]),
    StepPlan(step_id=1, new_requests=[new("c", [4, 8, 15])],
             scheduled=[item("b", 5, 8, blocks=(12, 5)), item("c", 0, 3, blocks=(20,))]),
    StepPlan(step_id=2, scheduled=[item("a", 6, 1), item("c", 3, 1)]),
]


def test_the_lead_computes_the_next_plan_while_the_shard_holds_one(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinySpec(num_layers=4), seed=3, quantized="Q8_0")
    whole = ModelRunner(path, model_name="tiny", block_size=4, num_blocks=32, num_threads=1)
    expected = [whole.step(plan) for plan in PLANS]
    assert all(not r.error and r.sampled_token_ids for r in expected)

    lead, shard = _lead_and_shard(path)
    shard_thread = ThreadPoolExecutor(1)  # the layer shard's process: one step at a time
    held, sent = threading.Event(), []

    def send(hidden, geometry) -> Future:
        number = len(sent)
        sent.append(number)
        query_lens, context_lens, tables = geometry
        step = ShardStep(step_id=0, part=0, num_parts=1, hidden=b"",
                         num_tokens=hidden.shape[0], query_lens=query_lens,
                         context_lens=context_lens, block_tables=tables)

        def run():
            if number == 0:  # the first plan stays in the shard until the second is sent
                assert held.wait(WAIT)
            return shard.run(step, hidden)
        return shard_thread.submit(run)

    lead.turns = LeadTurns()
    lead.model_forward = PipelinedForward(lead.model, send, 2, turns=lead.turns)
    tickets = [lead.turns.ticket() for _ in PLANS]
    with ThreadPoolExecutor(3) as threads:
        outcomes = [threads.submit(lead.execute, plan, ticket)
                    for plan, ticket in zip(PLANS, tickets, strict=True)]
        try:
            for _ in range(int(WAIT * 100)):
                if len(sent) == 2:
                    break
                threading.Event().wait(0.01)
            assert len(sent) == 2 and not outcomes[0].done()  # plan 1's layers ran meanwhile
        finally:
            held.set()
        results = [outcome.result(timeout=WAIT).result() for outcome in outcomes]
    shard_thread.shutdown()
    for mine, theirs in zip(results, expected, strict=True):
        assert not mine.error, mine.error
        assert (mine.sampled_token_ids, mine.logprobs) == (theirs.sampled_token_ids,
                                                           theirs.logprobs)

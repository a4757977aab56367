"""The scheduler's detokenizer routing, pure: each completion sticks to one live copy, and its
constants (its CompletionStart) go to a copy once: with its first update, again when it moves
to another copy or its copy lost the start, and with every update on the shared subject."""

from __future__ import annotations

from collections import Counter

from llmbus.bus import subjects
from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import (
    CompletionStart,
    FinishReason,
    Heartbeat,
    RequestTokens,
    SamplingParams,
    StepResult,
)
from llmbus.services.scheduler.config import SchedulerConfig
from llmbus.services.scheduler.detokenizer_routing import DetokenizerRouting, preferred_copy
from llmbus.services.scheduler.scheduler import Scheduler

START = CompletionStart(reply_subject="api", stop=["\n"])


def beat(instance: str) -> Heartbeat:
    return Heartbeat(service="detokenizer", instance_id=instance)


def routing_over(*copies: str) -> DetokenizerRouting:
    routing = DetokenizerRouting(Liveness(dead_after=2.0))
    for name in copies:
        routing.liveness.seen(beat(name), now=0.0)
    return routing


def update(request_id: str, tokens: list[int] = (1,), finish=FinishReason.NONE,
           first: bool = False) -> RequestTokens:
    """An update as the scheduler makes it: the start with a completion's first update only."""
    return RequestTokens(request_id=request_id, new_token_ids=list(tokens),
                         finish_reason=finish, start=START if first else None)


def only(routed: dict[str, list[RequestTokens]]) -> tuple[str, RequestTokens]:
    [(subject, [item])] = routed.items()
    return subject, item


def test_routing_is_sticky_and_moves_off_dead_copies():
    routing = DetokenizerRouting(Liveness(dead_after=2.0))
    assert set(routing.route([update("r", first=True)], now=0.0)) == {
        subjects.DETOKENIZER_TOKENS}
    for name in ("d0", "d1", "d2"):
        routing.liveness.seen(beat(name), now=0.0)
    ids = [f"r{i}" for i in range(30)]
    first = routing.route([update(i, first=True) for i in ids], now=0.1)
    assert len(first) == 3  # spread over every copy
    owner = {u.request_id: subject for subject, items in first.items() for u in items}
    again = routing.route([update(i) for i in ids], now=0.2)
    assert {u.request_id: subject for subject, items in again.items() for u in items} == owner
    dead = owner["r0"]
    for name in ("d0", "d1", "d2"):  # the others beat on (every 0.5 s; here at 1.5 and 2.5)
        if subjects.detokenizer_tokens(name) != dead:
            routing.liveness.seen(beat(name), now=1.5)
            routing.liveness.seen(beat(name), now=2.5)
    moved = routing.route([update("r0", finish=FinishReason.STOP)], now=3.0)
    assert dead not in moved
    assert ("r0", 0) not in routing.assigned  # finished: forgotten


def test_a_moved_completion_gets_its_start_again_with_the_tokens_its_dead_copy_had():
    """The copy taking a completion over gets the start, with the tokens sent so far to replay
    (and only then); a completion that stays put gets neither."""
    routing = routing_over("d0", "d1")
    sent = []
    for step in range(3):
        item = update("r", [10 + step, 20 + step], first=step == 0)
        owner, routed = only(routing.route([item], now=0.1 * step))
        assert (routed.start is START) == (step == 0)  # its first update: as the core made it
        sent += item.new_token_ids
    survivor = "d1" if owner == subjects.detokenizer_tokens("d0") else "d0"
    routing.liveness.seen(beat(survivor), now=1.5)  # it beats on; the owner fell silent
    routing.liveness.seen(beat(survivor), now=2.5)
    subject, routed = only(routing.route([update("r", [99])], now=3.0))
    assert subject == subjects.detokenizer_tokens(survivor)
    assert routed.start.replay_token_ids == sent
    assert (routed.start.reply_subject, routed.start.stop) == ("api", ["\n"])
    assert START.replay_token_ids == []  # the scheduler's start is left as it was
    _, routed = only(routing.route([update("r", [100], FinishReason.LENGTH)], now=3.1))
    assert routed.start is None  # it stayed on the survivor
    assert ("r", 0) not in routing.sent and ("r", 0) not in routing.starts  # finished


def test_every_update_to_the_shared_subject_carries_the_start():
    """No copy heard from yet: any copy of the queue group may take each update, so each one
    can set the completion up (replaying what came before)."""
    routing = DetokenizerRouting(Liveness(dead_after=2.0))
    starts = [only(routing.route([update("r", [t], first=t == 1)], now=0.0))[1].start
              for t in (1, 2, 3)]
    assert [s.replay_token_ids for s in starts] == [[], [1], [1, 2]]
    routing.liveness.seen(beat("d0"), now=0.0)
    subject, routed = only(routing.route([update("r", [4])], now=0.1))
    assert subject == subjects.detokenizer_tokens("d0")
    assert routed.start.replay_token_ids == [1, 2, 3]  # it may not have been d0 that had them
    assert only(routing.route([update("r", [5])], now=0.2))[1].start is None


def test_a_request_avoids_the_copies_its_owner_took_for_dead_while_another_is_alive():
    """d0 still counts alive here (this engine's view lags), but the request's api took it for
    dead: its completions go to d1; were d1 the copy avoided too, to any copy alive."""
    routing = routing_over("d0", "d1")
    ids = [f"r{i}" for i in range(40)]
    naturally = {i for i in ids if preferred_copy((i, 0), {"d0", "d1"}) == "d0"}
    assert naturally  # the ones the avoidance moves
    for request_id in ids:
        routing.avoid(request_id, ["d0"])
    routed = routing.route([update(i, first=True) for i in ids], now=0.1)
    assert set(routed) == {subjects.detokenizer_tokens("d1")}
    later = routing.route([update(i, finish=FinishReason.STOP) for i in ids], now=0.2)
    assert set(later) == {subjects.detokenizer_tokens("d1")}
    again = sorted(naturally)[0]  # its next attempt avoids nothing: hashing decides again
    routing.avoid(again, [])
    assert only(routing.route([update(again, first=True)], now=0.25))[0] == (
        subjects.detokenizer_tokens("d0"))
    routing.avoid("both", ["d0", "d1"])
    assert only(routing.route([update("both", first=True)], now=0.3))[0] in {
        subjects.detokenizer_tokens("d0"), subjects.detokenizer_tokens("d1")}


def _run(scheduler: Scheduler, routing: DetokenizerRouting, now: float,
         num_steps: int) -> list[tuple[str, RequestTokens]]:
    """Steps of the scheduler, every sampling row given token 7, their updates routed."""
    routed = []
    for _ in range(num_steps):
        plan = scheduler.schedule(now)
        count = sum(item.num_steps for item in plan.scheduled if item.sample)
        updates = scheduler.update(plan, StepResult(step_id=plan.step_id,
                                                    sampled_token_ids=[7] * count), now)
        routed += [(subject, u) for subject, items in routing.route(updates, now).items()
                   for u in items]
    return routed


def test_the_scheduler_sends_the_constants_once_per_completion_and_copy():
    """Requests of one and of n = 3 completions on three copies: each completion's start
    travels once, to its copy, with its first tokens; when a copy dies, the completions it had
    get it once more, on the copy taking them over, and the others never again."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64))
    routing = routing_over("d0", "d1", "d2")
    for i in range(6):
        scheduler.add_request(f"r{i}", "api.x", [10 + i, 11, 12, 13, 14],
                              SamplingParams(max_tokens=12, ignore_eos=True, stop=["stop"]),
                              n=3 if i % 2 else 1)
    before = _run(scheduler, routing, now=0.1, num_steps=4)
    completions = {(u.request_id, u.index) for _, u in before}
    assert len(completions) == 3 * 3 + 3
    starts = Counter(((u.request_id, u.index), subject) for subject, u in before if u.start)
    assert set(starts.values()) == {1} and {key for key, _ in starts} == completions
    owner = dict(starts)
    assert {u.start.reply_subject for _, u in before if u.start} == {"api.x"}
    assert {tuple(u.start.stop) for _, u in before if u.start} == {("stop",)}
    sent = Counter()
    for _, u in before:
        sent[(u.request_id, u.index)] += len(u.new_token_ids)

    dead = subjects.detokenizer_tokens("d0")
    for name in ("d1", "d2"):  # they beat on; d0 fell silent
        routing.liveness.seen(beat(name), now=1.5)
        routing.liveness.seen(beat(name), now=2.5)
    after = _run(scheduler, routing, now=3.0, num_steps=20)
    assert not scheduler.has_work
    moved = {key for key, subject in owner if subject == dead}
    assert moved  # rendezvous hashing gave d0 some of the twelve
    again = Counter(((u.request_id, u.index), subject) for subject, u in after if u.start)
    assert set(again.values()) == {1} and {key for key, _ in again} == moved
    assert dead not in {subject for _, subject in again}
    for _, u in after:
        if u.start:
            assert len(u.start.replay_token_ids) == sent[(u.request_id, u.index)]


def test_a_copy_that_lost_a_start_gets_it_again_and_nothing_to_replay():
    routing = routing_over("d0")
    only(routing.route([update("r", [1], first=True)], now=0.0))
    only(routing.route([update("r", [2])], now=0.1))
    assert not routing.lost(("r", 0), "d9")  # not the copy it went to: a stale report
    assert routing.lost(("r", 0), "d0")
    subject, routed = only(routing.route([update("r", [], FinishReason.ERROR)], now=0.2))
    assert subject == subjects.detokenizer_tokens("d0")
    assert routed.start is START and routed.start.replay_token_ids == []
    assert not routing.lost(("r", 0), "d0")  # ended: no longer running


def test_a_completion_that_ended_meanwhile_is_ended_with_an_error_on_the_reporting_copy():
    routing = routing_over("d0")
    only(routing.route([update("r", [1], first=True)], now=0.0))
    only(routing.route([update("r", [2], FinishReason.LENGTH)], now=0.1))
    assert routing.ended_error(("r", 0), "d9", "lost") is None  # it did not end there
    subject, error = routing.ended_error(("r", 0), "d0", "lost")
    assert subject == subjects.detokenizer_tokens("d0")
    assert (error.finish_reason, error.error, error.start) == (FinishReason.ERROR, "lost",
                                                               START)
    assert routing.ended_error(("r", 0), "d0", "lost") is None  # once

"""Which faults move a request, judged from the api's tables of who is alive
(services/api/migration_bus.py): a fault is the current attempt's, never an attempt already
left behind; an attempt admitted while a fault of its engine was being judged is checked when
its admission is back; each attempt names the detokenizer copies its tokens must avoid."""

from __future__ import annotations

import asyncio

from llmbus.bus.messages import Admission, GenerateRequest, Heartbeat
from tests.api.migrations_fake import REQUEST, migrations_over

STAGES_UP = {"scheduler", "tokenizer", "executor"}


def _recording(migrations) -> list[GenerateRequest]:
    """The attempts `migrations` sends, each admitted by engine e3 with no reconnect."""
    sent: list[GenerateRequest] = []

    async def admit(request: GenerateRequest) -> Admission:
        sent.append(request)
        return Admission(num_prompt_tokens=1, scheduler_instance_id="e3")

    migrations.admit = admit
    return sent


def _engine(name: str, reconnects: int = 0) -> Heartbeat:
    return Heartbeat(service="scheduler", instance_id=name, engine_id=name,
                     num_reconnects=reconnects)


async def test_a_reconnect_of_the_engine_a_request_is_leaving_does_not_move_it_again():
    """The api's own reconnect moves a request off e1; while that move is on its way, e1's
    heartbeat shows it reconnected too (one server's death, seen by two stages): that was the
    old attempt's engine, so the new attempt, on e3, stays."""
    migrations, _ = migrations_over(STAGES_UP, refusals=0)
    sent = _recording(migrations)
    placement = migrations.track(REQUEST, asyncio.Queue())
    migrations.admitted(placement, Admission(num_prompt_tokens=1, scheduler_instance_id="e1"))
    sent.clear()
    migrations._migrate(placement, "the api lost its bus connection")
    migrations.recover_from(_engine("e1", reconnects=1))  # before the new admission is back
    await asyncio.sleep(0.05)
    assert [r.attempt for r in sent] == [1] and placement.scheduler_instance_id == "e3"


async def test_an_attempt_whose_engine_failed_while_its_admission_came_moves_again():
    """Engine e2 took the first attempt, and meanwhile was reaped, or reconnected (its latest
    heartbeat counts one more reconnect than its admission did): it moves once more."""
    for fail in ("reaped", "reconnected"):
        migrations, _ = migrations_over(STAGES_UP, refusals=0)
        sent = _recording(migrations)
        schedulers = migrations.copies["scheduler"]
        schedulers.seen(_engine("e2", reconnects=int(fail == "reconnected")), 100.0)
        if fail == "reaped":
            assert [h.instance_id for h in schedulers.reap(107.0)] == ["e2"]
        placement = migrations.track(REQUEST, asyncio.Queue())
        migrations.admitted(placement, Admission(num_prompt_tokens=1,
                                                 scheduler_instance_id="e2"))
        await asyncio.sleep(0.05)
        assert [r.attempt for r in sent] == [1], fail
        assert placement.scheduler_instance_id == "e3"


async def test_every_attempt_names_the_detokenizer_copies_this_api_took_for_dead():
    """An engine may count a copy alive for seconds after this api reaped it (it reconnected,
    which pardons silences); a short request it sent there would be lost whole, after the api
    had moved it off that copy: so each attempt names the copies to avoid."""
    migrations, _ = migrations_over(STAGES_UP, refusals=0)
    sent = _recording(migrations)
    detokenizers = migrations.copies["detokenizer"]
    for name in ("d2", "d3"):
        detokenizers.seen(Heartbeat(service="detokenizer", instance_id=name), 100.0)
    detokenizers.seen(Heartbeat(service="detokenizer", instance_id="d3"), 104.0)
    assert [h.instance_id for h in detokenizers.reap(107.0)] == ["d2"]
    placement = migrations.track(REQUEST, asyncio.Queue())
    assert placement.request.avoid_detokenizer_ids == ["d2"]
    assert REQUEST.avoid_detokenizer_ids == []  # the caller's request is left as it was
    migrations.admitted(placement, Admission(num_prompt_tokens=1, scheduler_instance_id="e1"))
    migrations._migrate(placement, "detokenizer d2 stopped answering")
    await asyncio.sleep(0.05)
    assert [r.avoid_detokenizer_ids for r in sent] == [["d2"]] and placement.attempt == 1
    detokenizers.seen(Heartbeat(service="detokenizer", instance_id="d2"), 108.0)  # back
    assert migrations.track(REQUEST, asyncio.Queue()).request.avoid_detokenizer_ids == []

"""How long a resumed request waits for the pipeline to take it (services/api/migration_bus.py,
`Migrations._admit_soon`): past RESUME_PATIENCE only while some copy of each stage an
admission needs (a tokenizer, and an engine's scheduler and executor, not a prefill engine's)
is still counted alive, the cluster settling after a fault (issue 46: stages moving to
another server answer late); with a stage empty it fails after the first few seconds. The
admission is a function that refuses (503) a given number of times; the patience constants
are scaled down, so the test waits for nothing real."""

from __future__ import annotations

import time

import pytest

from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import Admission, GenerateRequest, Heartbeat, SamplingParams
from llmbus.services.api import migration_bus
from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.migration_bus import Migrations

STAGES = ("scheduler", "tokenizer", "detokenizer", "executor", "api")


class _Runtime:  # what Migrations asks of its bus runtime here
    connected = True

    def bus_time(self) -> float:
        return time.monotonic()

    async def publish(self, *_: object) -> None:  # a resumption's abort of the old attempt
        return None


def _migrations(alive: set[str], refusals: int,
                role: str = "mixed") -> tuple[Migrations, list[float]]:
    copies = {stage: Liveness() for stage in STAGES}
    for stage in alive:  # heard from an hour ahead: alive throughout; one engine, e0
        copies[stage].seen(Heartbeat(service=stage, instance_id=f"{stage}-1",
                                     engine_id="e0" if stage in ("scheduler", "executor") else "",
                                     role=role if stage == "scheduler" else ""),
                           time.monotonic() + 3600)
    tries: list[float] = []

    async def admit(_: GenerateRequest) -> Admission:
        tries.append(time.monotonic())
        if len(tries) <= refusals:
            raise OpenAIError(503, "the pipeline did not admit the request in time")
        return Admission(num_prompt_tokens=1)

    async def abort(_: str) -> None:
        return None

    return Migrations(_Runtime(), copies, admit, abort), tries  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(migration_bus, "RESUME_PATIENCE", 0.05)
    monkeypatch.setattr(migration_bus, "RESUME_PATIENCE_SETTLING", 0.5)
    monkeypatch.setattr(migration_bus, "RESUME_RETRY_SECONDS", 0.01)


REQUEST = GenerateRequest(request_id="r1", reply_subject="api.x", model="m", prompt="hi",
                          params=SamplingParams())


async def test_while_an_engine_and_a_tokenizer_are_alive_a_refused_resumption_tries_again():
    migrations, tries = _migrations({"scheduler", "tokenizer", "executor"}, refusals=15)
    admission = await migrations._admit_soon(REQUEST)
    assert admission.num_prompt_tokens == 1 and len(tries) == 16  # past RESUME_PATIENCE (0.05 s)


async def test_the_settling_wait_has_an_end():
    migrations, tries = _migrations({"scheduler", "tokenizer", "executor"}, refusals=10_000)
    with pytest.raises(OpenAIError):
        await migrations._admit_soon(REQUEST)
    assert 0.5 <= tries[-1] - tries[0] < 5.0


@pytest.mark.parametrize("alive", [set(), {"scheduler", "tokenizer"},  # the executor died
                                   {"scheduler", "executor"}, {"tokenizer", "executor"}])
async def test_with_a_stage_empty_it_gives_up_after_the_first_patience(alive):
    migrations, tries = _migrations(alive, refusals=10_000)
    with pytest.raises(OpenAIError):
        await migrations._admit_soon(REQUEST)
    assert tries[-1] - tries[0] < 0.5  # RESUME_PATIENCE (0.05 s) and a try or two, not 0.5


async def test_a_prefill_engine_alone_admits_nothing_so_it_does_not_wait():
    """Disaggregated serving whose decode engine died: the prefill engine's scheduler and
    executor are alive, but a prefill engine takes no request of its own."""
    migrations, tries = _migrations({"scheduler", "tokenizer", "executor"}, refusals=10_000,
                                    role="prefill")
    with pytest.raises(OpenAIError):
        await migrations._admit_soon(REQUEST)
    assert tries[-1] - tries[0] < 0.5



# Every detokenizer copy silent (`Migrations._detokenizers_may_return`): the api ends every
# request at once when the detokenizers alone fell silent (they died), and waits while copies
# of other stages fell silent with them (a server they shared went away; issue 46's compound
# case), at most RESUME_PATIENCE_SETTLING (30 s). Times are seconds on a made-up clock;
# DEAD_AFTER is 6.

def _copies_heard(monkeypatch, last_heard: dict[str, float]) -> Migrations:
    """One copy of each stage, each last heard at the time given (an hour ahead if not)."""
    monkeypatch.setattr(migration_bus, "RESUME_PATIENCE_SETTLING", 30.0)
    migrations, _ = _migrations(set(), refusals=0)
    for stage in STAGES:
        migrations.copies[stage].seen(Heartbeat(service=stage, instance_id=f"{stage}-1"),
                                      last_heard.get(stage, 3600.0))
    return migrations


def test_detokenizers_silent_alone_are_dead(monkeypatch):
    migrations = _copies_heard(monkeypatch, {"detokenizer": 100.0})
    assert not migrations._detokenizers_may_return(107.0)


@pytest.mark.parametrize("stage", ["scheduler", "tokenizer", "executor", "api"])
def test_detokenizers_silent_with_another_stage_may_be_moving_servers(monkeypatch, stage):
    migrations = _copies_heard(monkeypatch, {"detokenizer": 100.0, stage: 100.5})
    assert migrations._detokenizers_may_return(107.0)
    assert migrations._detokenizers_may_return(129.0)
    assert not migrations._detokenizers_may_return(131.0)  # past the settling patience


def test_a_copy_reaped_meanwhile_still_fell_silent_with_them(monkeypatch):
    migrations = _copies_heard(monkeypatch, {"detokenizer": 100.0, "scheduler": 99.0})
    [gone] = migrations.copies["scheduler"].reap(106.0)  # the engine watch's verdict
    assert gone.instance_id == "scheduler-1" and not migrations.copies["scheduler"].last_seen
    assert migrations._detokenizers_may_return(107.0)


def test_a_copy_that_fell_silent_long_before_is_another_story(monkeypatch):
    migrations = _copies_heard(monkeypatch, {"detokenizer": 100.0, "executor": 90.0})
    assert not migrations._detokenizers_may_return(107.0)


async def test_a_fault_before_the_first_admission_moves_the_request_once_it_is_back():
    """A request whose first attempt is still on its way to an engine (the tokenizer trying
    one that does not answer) when a fault would move it: it moves once that admission is
    back, never while the first attempt may still be taken late (an engine would then refuse
    it as stale, and the client would get that refusal)."""
    import asyncio

    migrations, tries = _migrations({"scheduler", "tokenizer", "executor"}, refusals=0)
    placement = migrations.track(REQUEST, asyncio.Queue())
    migrations._migrate(placement, "detokenizer d2 stopped answering")
    await asyncio.sleep(0.05)
    assert tries == []  # nothing moves while the first admission is out
    migrations.admitted(placement, Admission(num_prompt_tokens=1, scheduler_instance_id="e1"))
    await asyncio.sleep(0.05)
    assert len(tries) == 1 and placement.attempt == 1


async def test_every_attempt_names_the_detokenizer_copies_this_api_took_for_dead():
    """An engine may count a copy alive for seconds after this api reaped it (it reconnected,
    which pardons silences); a short request it sent there would be lost whole, after the api
    had moved it off that copy: so each attempt names the copies to avoid."""
    import asyncio

    migrations, _ = _migrations({"scheduler", "tokenizer", "executor"}, refusals=0)
    sent: list[GenerateRequest] = []

    async def admit(request: GenerateRequest) -> Admission:
        sent.append(request)
        return Admission(num_prompt_tokens=1, scheduler_instance_id="e1")

    migrations.admit = admit
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

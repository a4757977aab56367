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

from llmbus.bus.messages import Admission, Heartbeat
from llmbus.services.api import migration_bus
from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.migration_bus import Migrations
from tests.api.migrations_fake import REQUEST, STAGES, migrations_over


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(migration_bus, "RESUME_PATIENCE", 0.05)
    monkeypatch.setattr(migration_bus, "RESUME_PATIENCE_SETTLING", 0.5)
    monkeypatch.setattr(migration_bus, "RESUME_RETRY_SECONDS", 0.01)


async def test_while_an_engine_and_a_tokenizer_are_alive_a_refused_resumption_tries_again():
    migrations, tries = migrations_over({"scheduler", "tokenizer", "executor"}, refusals=15)
    admission = await migrations._admit_soon(REQUEST)
    assert admission.num_prompt_tokens == 1 and len(tries) == 16  # past RESUME_PATIENCE (0.05 s)


async def test_the_settling_wait_has_an_end():
    migrations, tries = migrations_over({"scheduler", "tokenizer", "executor"}, refusals=10_000)
    started = time.monotonic()
    with pytest.raises(OpenAIError):
        await migrations._admit_soon(REQUEST)
    # It gives up once more than the patience (0.5) has passed since it started, and soon
    # after; the tries themselves are stamped a moment after it starts and before it looks.
    assert 0.5 < time.monotonic() - started < 5.0 and len(tries) > 1


@pytest.mark.parametrize("alive", [set(), {"scheduler", "tokenizer"},  # the executor died
                                   {"scheduler", "executor"}, {"tokenizer", "executor"}])
async def test_with_a_stage_empty_it_gives_up_after_the_first_patience(alive):
    migrations, tries = migrations_over(alive, refusals=10_000)
    with pytest.raises(OpenAIError):
        await migrations._admit_soon(REQUEST)
    assert tries[-1] - tries[0] < 0.5  # RESUME_PATIENCE (0.05 s) and a try or two, not 0.5


async def test_a_prefill_engine_alone_admits_nothing_so_it_does_not_wait():
    """Disaggregated serving whose decode engine died: the prefill engine's scheduler and
    executor are alive, but a prefill engine takes no request of its own."""
    migrations, tries = migrations_over({"scheduler", "tokenizer", "executor"}, refusals=10_000,
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
    migrations, _ = migrations_over(set(), refusals=0)
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

    migrations, tries = migrations_over({"scheduler", "tokenizer", "executor"}, refusals=0)
    placement = migrations.track(REQUEST, asyncio.Queue())
    migrations._migrate(placement, "detokenizer d2 stopped answering")
    await asyncio.sleep(0.05)
    assert tries == []  # nothing moves while the first admission is out
    migrations.admitted(placement, Admission(num_prompt_tokens=1, scheduler_instance_id="e1"))
    await asyncio.sleep(0.05)
    assert len(tries) == 1 and placement.attempt == 1


"""The scheduler's view of its executor's silence (peers_bus.Peers.executor_silent): an
executor killed before its first heartbeat reached the scheduler was never taken for dead,
and the step it held waited forever (tests/e2e/test_faults.py timed out now and then)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from llmbus.bus.liveness import DEAD_AFTER
from llmbus.services.scheduler.peers_bus import Peers


def _peers(clock: list[float]) -> Peers:
    runtime = SimpleNamespace(bus_time=lambda: clock[0])  # the last round trip to the server
    return Peers(runtime, "engine0", detokenizers=None)  # type: ignore[arg-type]


def test_an_executor_found_but_never_heard_from_goes_silent_after_dead_after():
    clock = [time.monotonic()]
    peers = _peers(clock)
    peers.executor_found()
    assert not peers.executor_silent()
    clock[0] += DEAD_AFTER + 1
    assert peers.executor_silent()


def test_nothing_is_silent_before_the_executor_is_found():
    clock = [time.monotonic() + DEAD_AFTER + 1]
    assert not _peers(clock).executor_silent()

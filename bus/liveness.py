"""Who is alive: heartbeats on the bus, and a pure tracker of the last time each copy spoke.

Every service copy publishes a Heartbeat on `llmbus.v1.heartbeat.<service>` once a
`HEARTBEAT_INTERVAL`; a copy not heard from for `DEAD_AFTER` is taken for dead. Heartbeats
carry load, so the same message feeds routing (engines) and failure detection (everyone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmbus.bus.messages import Heartbeat

HEARTBEAT_INTERVAL = 0.5  # seconds
# Seconds of silence: more than a hung server takes to be noticed (2-3 s, bus/servers.py) plus
# a reconnect and a heartbeat, so a copy whose connection is being re-established is not
# taken for dead. What a watcher misses while its own connection hangs does not count at all
# (ServiceRuntime.bus_time).
DEAD_AFTER = 4.0
# How long a reaped copy's last heartbeat is remembered (`Liveness.fell_silent`).
REMEMBER_REAPED = 300.0


@dataclass
class Liveness:
    """Last heartbeat of each instance of one service. Time is an argument (testable)."""

    dead_after: float = DEAD_AFTER
    last_seen: dict[str, float] = field(default_factory=dict)
    latest: dict[str, Heartbeat] = field(default_factory=dict)
    reaped: dict[str, float] = field(default_factory=dict)  # instance: its last heartbeat

    def seen(self, heartbeat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True if the instance is new (or back after silence)."""
        fresh = heartbeat.instance_id not in self.last_seen
        self.last_seen[heartbeat.instance_id] = now
        self.reaped.pop(heartbeat.instance_id, None)
        self.latest[heartbeat.instance_id] = heartbeat
        return fresh

    def pardon(self, now: float) -> None:
        """Our own bus connection was down: the others' silence meanwhile says nothing about
        them, so each counts as heard from now (one that really died is reaped DEAD_AFTER
        later)."""
        for instance_id in self.last_seen:
            self.last_seen[instance_id] = now

    def alive(self, now: float) -> list[Heartbeat]:
        return [self.latest[i] for i, t in sorted(self.last_seen.items())
                if now - t <= self.dead_after]

    def reap(self, now: float) -> list[Heartbeat]:
        """Forget instances silent for too long; returns them (each once)."""
        dead = [i for i, t in self.last_seen.items() if now - t > self.dead_after]
        self.reaped = {i: t for i, t in self.reaped.items() if now - t <= REMEMBER_REAPED}
        return [self._forget(i) for i in dead]

    def fell_silent(self, now: float) -> list[float]:
        """The last heartbeat of each copy silent now, past `dead_after`: those still counted
        and those reaped in the last REMEMBER_REAPED seconds. Copies that fell silent at the
        same moment point at one cause, such as the server they shared."""
        return [t for t in self.last_seen.values() if now - t > self.dead_after] + [
            t for t in self.reaped.values() if now - t <= REMEMBER_REAPED]

    def _forget(self, instance_id: str) -> Heartbeat:
        self.reaped[instance_id] = self.last_seen.pop(instance_id)
        return self.latest.pop(instance_id)

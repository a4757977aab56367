"""Who is alive: heartbeats on the bus, and a pure tracker of the last time each copy spoke.

Every service copy publishes a Heartbeat on `llmbus.v1.heartbeat.<service>` once a
`HEARTBEAT_INTERVAL`; a copy not heard from for `DEAD_AFTER` is taken for dead. Heartbeats
carry load, so the same message feeds routing (engines) and failure detection (everyone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmbus.bus.messages import Heartbeat

HEARTBEAT_INTERVAL = 0.5  # seconds
# Seconds of silence: more than a hung server takes to be noticed (2-3 s, bus/servers.py), its
# connection's close cut short (1 s more over TLS), a reconnect and a heartbeat, with room for
# a busy machine, so a copy whose connection is being re-established is not taken for dead
# (at 4 s, the chaos soak saw copies whose server was cut off reaped as they came back). What
# a watcher misses while its own connection hangs does not count at all
# (ServiceRuntime.bus_time).
DEAD_AFTER = 6.0
# How long a reaped copy's last heartbeat is remembered (`Liveness.fell_silent`).
REMEMBER_REAPED = 300.0


@dataclass
class Liveness:
    """Last heartbeat of each instance of one service. Time is an argument (testable)."""

    dead_after: float = DEAD_AFTER
    last_seen: dict[str, float] = field(default_factory=dict)
    latest: dict[str, Heartbeat] = field(default_factory=dict)
    reaped: dict[str, float] = field(default_factory=dict)  # instance: its last heartbeat
    # Each copy's dead incarnation, to reap: one a copy (tables no one reaps stay bounded).
    restarted: dict[str, Heartbeat] = field(default_factory=dict)

    def seen(self, heartbeat: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True if the instance is new (or back after silence).

        A known copy heard again after every copy fell silent at once pardons them all
        first: a silence of all says more about the path to this watcher (its server cut
        off from the cluster) than about each of them, and a watcher that reaps when
        heartbeats arrive would otherwise reap, on that first one, every copy whose own
        heartbeat is a moment behind. (A new copy pardons nobody: it may be the first of
        its stage after the others died.)"""
        fresh = heartbeat.instance_id not in self.last_seen
        if not fresh and now - max(self.last_seen.values()) > self.dead_after:
            self.pardon(now)
        before = self.latest.get(heartbeat.instance_id)
        if before is not None and before.incarnation != heartbeat.incarnation:
            self.restarted.setdefault(heartbeat.instance_id, before)  # the old one died
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
        """Forget instances silent for too long; returns them (each once), and the last
        heartbeat of each copy that started again since (its new start stays counted)."""
        dead = [i for i, t in self.last_seen.items() if now - t > self.dead_after]
        self.reaped = {i: t for i, t in self.reaped.items() if now - t <= REMEMBER_REAPED}
        restarted, self.restarted = list(self.restarted.values()), {}
        return [self._forget(i) for i in dead] + restarted

    def fell_silent(self, now: float) -> list[float]:
        """The last heartbeat of each copy silent now, past `dead_after`: those still counted
        and those reaped in the last REMEMBER_REAPED seconds. Copies that fell silent at the
        same moment point at one cause, such as the server they shared."""
        return [t for t in self.last_seen.values() if now - t > self.dead_after] + [
            t for t in self.reaped.values() if now - t <= REMEMBER_REAPED]

    def _forget(self, instance_id: str) -> Heartbeat:
        self.reaped[instance_id] = self.last_seen.pop(instance_id)
        return self.latest.pop(instance_id)

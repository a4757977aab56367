"""Two plans at once on a split model's lead shard: while the layer shards compute one plan,
the lead computes the next plan's first layers, so that every shard is busy.

A plan computes on the lead in two turns: its bookkeeping and its own layers (then it sends
the hidden states on, and waits for the shards, holding no turn), and its head and sampling
once they come back. Turns go one at a time (the lead's cores do one thing at once) and in
the order the plans came: a plan's first turn after every earlier plan's first turn, its
second after every earlier plan has ended, so each layer shard sees the plans in order (a
prompt chunk attends to the keys the chunk before wrote) and results leave in order. A plan
that needs what an earlier one still in flight samples (a decode's input token) or changes
(a sequence it forgets) waits for that plan to end: `independent` says which may overlap.
The scheduler plans overlapping work only for split engines (planner.py).

Tickets are drawn in the order plans arrive, on the event loop; each plan's thread then takes
its turns with its ticket (`plan`, and `away` while it waits for the shards). Pure: threads,
no bus, no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from llmbus.bus.messages import StepPlan

T = TypeVar("T")


def independent(plan: StepPlan, earlier: StepPlan) -> bool:
    """Whether `plan` may compute before `earlier` has ended: it reads no token `earlier`
    samples, forgets, preempts or registers none of its sequences, and neither takes several
    forwards (each of which waits for the one before)."""
    if plan.multi_step() or earlier.multi_step():
        return False
    sampling = {item.sequence_id for item in earlier.scheduled if item.sample}
    touched = {item.sequence_id for item in earlier.scheduled}
    return not (any(item.sequence_id in sampling for item in plan.scheduled)
                or touched.intersection(plan.finished_sequence_ids)
                or touched.intersection(plan.preempted_sequence_ids)
                or any(new.sequence_id in touched for new in plan.new_requests))


class LeadTurns:
    """Who computes on the lead shard now: at most one plan's thread, in the order above."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._next_ticket = 0
        self._sent = 0  # every plan with a smaller ticket has had its first turn
        self._open: dict[int, StepPlan] = {}  # plans begun and not ended, by ticket
        self._computing = False
        self._mine = threading.local()  # the ticket of the plan this thread runs

    def ticket(self) -> int:
        """The next plan's place, drawn in the order plans arrive."""
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        return ticket

    @contextmanager
    def plan(self, ticket: int, plan: StepPlan) -> Iterator[None]:
        """Run `plan` (this thread's) in its turns: the first begins on entry; leaving ends
        the plan."""
        with self._changed:
            self._changed.wait_for(lambda: self._sent >= ticket and not self._computing and all(
                independent(plan, earlier) for earlier in self._open.values()))
            self._open[ticket] = plan
            self._computing = True
        self._mine.ticket = ticket
        try:
            yield
        finally:
            self._mine.ticket = None
            with self._changed:
                del self._open[ticket]
                self._sent = max(self._sent, ticket + 1)
                self._computing = False
                self._changed.notify_all()

    def away(self, wait: Callable[[], T]) -> T:
        """`wait()` (for the layer shards) outside this thread's turn, so that the next plan
        computes meanwhile; the plan's second turn begins once every earlier plan ended. Just
        `wait()` for a thread that runs no plan in turns."""
        ticket = getattr(self._mine, "ticket", None)
        if ticket is None:
            return wait()
        with self._changed:
            self._sent = max(self._sent, ticket + 1)
            self._computing = False
            self._changed.notify_all()
        try:
            return wait()
        finally:
            with self._changed:
                self._changed.wait_for(lambda: not self._computing
                                       and min(self._open) == ticket)
                self._computing = True

"""The executor's spans: one per step, linked to the trace of every request in it (a step
serves many requests, so it belongs to none), and one per sequence for its time in this
executor, from the plan that brought it to the plan that finished it."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.trace import Link, Span

from llmbus.bus.messages import StepPlan
from llmbus.bus.tracing import context_from_traceparent, link_to

_tracer = trace.get_tracer("llmbus.executor")


class StepTraces:
    """The links to the traces of the sequences here, and when each arrived."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}  # sequence id -> link to its request's trace
        self._residents: dict[str, tuple[int, str]] = {}  # -> (registered at, traceparent)

    def step_span(self, plan: StepPlan) -> AbstractContextManager[Span]:
        """The span of the plan's step (to enter around it), after the plan's bookkeeping:
        a finished sequence's residency recorded, a new one's link kept."""
        for sequence_id in plan.finished_sequence_ids:
            self._links.pop(sequence_id, None)
            if sequence_id in self._residents:
                _record_residency(sequence_id, *self._residents.pop(sequence_id))
        for new in plan.new_requests:
            link = link_to(new.traceparent)
            if link is not None:
                self._links[new.sequence_id] = link
                self._residents[new.sequence_id] = (time.time_ns(), new.traceparent)
        links = [self._links[s.sequence_id] for s in plan.scheduled
                 if s.sequence_id in self._links]
        return _tracer.start_as_current_span("executor.step", links=links, attributes={
            "llmbus.step_id": plan.step_id, "llmbus.batch_size": len(plan.scheduled),
            "llmbus.num_tokens": sum(s.num_tokens for s in plan.scheduled)})


def _record_residency(sequence_id: str, started_ns: int, traceparent: str) -> None:
    """The sequence's time in this executor, as a span of its request's trace (steps link to
    it)."""
    _tracer.start_span("executor.request", context=context_from_traceparent(traceparent),
                       start_time=started_ns,
                       attributes={"llmbus.sequence_id": sequence_id}).end()

"""Disaggregated prefill: a decode engine sends a long uncached prompt's prefill to a prefill
engine, which pushes the prompt's KV into blocks the decode engine holds for it
(docs/architecture.md, "Disaggregated prefill").

- rule.py: whether a waiting request's prompt goes to a prefill engine, and to which one
  (predicted time to the first token, there and here). Pure.
- tries.py: the decode engine's books of the prefills under way, one transfer id per try, and
  the messages they queue up (starts, cancels, closed transfers). Pure.
- transitions.py: the request's states on the decode engine (WAITING -> REMOTE -> RUNNING, or
  back to WAITING when a try is given up), on the scheduler's queues and blocks. Pure.
- remote_prefill_bus.py: both ends on the bus: the decode side asks a prefill engine and hears
  its answer and its heartbeats; the prefill side takes the prompt as a one-token request.
"""

"""Received by any stage: liveness and pings."""

from __future__ import annotations

from llmbus.bus.messages.common import Message


class Heartbeat(Message):
    """I am alive (and this busy). Engines fill in the load fields; others leave them 0."""

    service: str
    instance_id: str
    engine_id: str = ""
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 0
    num_handled: int = 0  # work done so far (requests, batches or steps): who did what
    # Times this copy's bus connection was re-established: a watcher that sees it grow knows
    # that messages to and from it may have been lost meanwhile.
    num_reconnects: int = 0
    role: str = ""  # an engine's: "mixed" (or empty), "prefill" or "decode"
    num_queued_tokens: int = 0  # an engine's prompt tokens not computed yet (held or queued)
    num_evictable_blocks: int = 0  # cached blocks no request holds: free for the taking
    # A layer shard of the engine's executor ("1/2": shard 1 of 2; layer_slice.py); its
    # engine's scheduler watches the lead shard (0), which answers for every shard.
    shard: str = ""
    # An engine's LoRA adapters resident in its executor (by name): routers prefer an engine
    # that holds a request's adapter, the pipeline page shows them.
    adapters: list[str] = []
    # A random id of this process's start: a copy killed and started again under the same
    # instance id within DEAD_AFTER is told apart from the one that died (and what that one
    # held is recovered as from a death).
    incarnation: str = ""


class Ping(Message):
    pass


class Pong(Message):
    service: str
    instance_id: str
    ready: bool = True

"""A decode engine's books of the prompts another engine prefills for it (rule.py says which).
Each is a request holding its blocks here, waiting for its KV and first token; every try has
its own transfer id (`<engine>/<sequence>><try>`: unique across engines too), so a late answer
to a try given up is told apart. Pure: transitions.py moves the requests between the
scheduler's queues, remote_prefill_bus.py sends the messages these books queue up."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmbus.services.scheduler.request import Request


@dataclass
class RemotePrefill:
    request: Request
    transfer_id: str
    engine_id: str  # the prefill engine
    instance_id: str  # ... its scheduler copy, whose death ends the try
    first_block: int  # blocks before it are this engine's cached prefix
    started: float = 0.0  # the caller's clock


@dataclass
class RemotePrefills:
    engine_id: str = ""  # this engine's, in its transfer ids
    by_transfer: dict[str, RemotePrefill] = field(default_factory=dict)
    num_tries: int = 0
    starts: list[RemotePrefill] = field(default_factory=list)  # to send: PrefillRequest
    cancels: list[RemotePrefill] = field(default_factory=list)  # to send: a cancel to P
    closed: list[str] = field(default_factory=list)  # for the executor: take no more blocks

    def __len__(self) -> int:
        return len(self.by_transfer)

    def requests(self) -> list[Request]:
        return [r.request for r in self.by_transfer.values()]

    def start(self, request: Request, engine_id: str, instance_id: str, first_block: int,
              now: float) -> RemotePrefill:
        self.num_tries += 1
        transfer_id = f"{self.engine_id}/{request.sequence_id}>{self.num_tries}"
        remote = RemotePrefill(request, transfer_id, engine_id,
                               instance_id, first_block, now)
        self.by_transfer[remote.transfer_id] = remote
        request.remote.transfer_id = remote.transfer_id
        self.starts.append(remote)
        return remote

    def end(self, transfer_id: str, cancel: bool) -> RemotePrefill | None:
        """The try is over (done, failed or given up); None if it was not pending."""
        remote = self.by_transfer.pop(transfer_id, None)
        if remote is None:
            return None
        remote.request.remote.transfer_id = ""
        self.closed.append(transfer_id)
        if remote in self.starts:  # never sent: nothing to cancel
            self.starts.remove(remote)
        elif cancel:
            self.cancels.append(remote)
        return remote

    def on_engine(self, instance_id: str) -> list[str]:
        """The transfer ids pending on one prefill engine's scheduler copy."""
        return [t for t, r in self.by_transfer.items() if r.instance_id == instance_id]

    def older_than(self, deadline: float) -> list[str]:
        return [t for t, r in self.by_transfer.items() if r.started < deadline]

    def take_starts(self) -> list[RemotePrefill]:
        starts, self.starts = self.starts, []
        return starts

    def take_cancels(self) -> list[RemotePrefill]:
        cancels, self.cancels = self.cancels, []
        return cancels

    def take_closed(self) -> list[str]:
        closed, self.closed = self.closed, []
        return closed

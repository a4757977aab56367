"""The scheduler's view of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from bus.messages import FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    reply_subject: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never beyond the context window
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Lags the token count by one while decoding: the newest
    # sampled token is computed in the next step.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason = FinishReason.NONE
    known_to_executor: bool = False
    # Output tokens not yet sent to the detokenizer.
    num_sent_tokens: int = 0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

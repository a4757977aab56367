"""What the runner made of one plan (`ModelRunner.execute`), and the StepResult the service
builds from it with what only the service knows."""

from __future__ import annotations

from dataclasses import dataclass

from llmbus.bus.messages import KvTransferReport, PooledEmbedding, StepResult
from llmbus.services.executor.sampling.sampled_tokens import SampledTokens


@dataclass(frozen=True)
class StepOutcome:
    """What the runner made of one plan: the tokens sampled, or the error that stopped it."""

    step_id: int
    sampled: SampledTokens
    forward_seconds: float = 0.0
    batch_size: int = 0
    num_tokens: int = 0
    error: str = ""
    embeddings: tuple[PooledEmbedding, ...] = ()  # embedding requests whose prompt ended

    def result(self, *, idle_seconds: float = 0.0,
               transfers: list[KvTransferReport] | None = None) -> StepResult:
        """The step's StepResult, with what only the service knows: how long the executor
        waited for this plan, and the KV transfers that ended with the step."""
        return StepResult(
            step_id=self.step_id, sampled_token_ids=self.sampled.token_ids,
            forward_seconds=self.forward_seconds, batch_size=self.batch_size,
            num_tokens=self.num_tokens, error=self.error, idle_seconds=idle_seconds,
            logprobs=self.sampled.logprobs, num_sampled=self.sampled.num_sampled,
            transfers=transfers or [], embeddings=list(self.embeddings))

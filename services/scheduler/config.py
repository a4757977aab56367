"""An engine's scheduling limits: its KV cache's shape, the model's context, the batch caps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 64
    # Chunked prefill's step size; why 256: docs/benchmarks.md, "Step budget".
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    # Speculative decoding (ngram_proposer.py): up to this many draft tokens per step, from
    # earlier matches of the last spec_ngram_max..spec_ngram_min tokens; 0 = off.
    num_speculative_tokens: int = 0
    spec_ngram_min: int = 2
    spec_ngram_max: int = 4
    # Multi-step decoding (multi_step.py): tokens a small batch's decodes take per step, at
    # most, and about how long such a step may take (fewer steps when forwards are slow).
    decode_steps: int = 1
    decode_plan_seconds: float = 0.08

    def __post_init__(self) -> None:
        check_speculation(self.num_speculative_tokens, self.spec_ngram_min,
                          self.spec_ngram_max)
        if self.decode_steps < 1:
            raise ValueError(f"--decode-steps must be 1 or more, got {self.decode_steps}")
        if not self.decode_plan_seconds > 0:
            raise ValueError("--decode-plan-ms must be positive, got "
                             f"{self.decode_plan_seconds * 1000:g}")


def check_speculation(num_tokens: int, ngram_min: int, ngram_max: int) -> None:
    """Raises ValueError, naming the options, for settings speculation cannot run with."""
    if num_tokens < 0:
        raise ValueError(f"--num-speculative-tokens must be 0 (off) or more, got {num_tokens}")
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError("need 1 <= --spec-ngram-min <= --spec-ngram-max, got "
                         f"{ngram_min} and {ngram_max}")

"""A BERT-family encoder (backends/torch_encoder.py) behind the Backend contract, so that an
embedding engine runs the same runner, scheduler and bus as any other.

The runner and the scheduler think in KV blocks; an encoder keeps no KV. Its engine's cache
has no layers (`bookkeeping_config`: zero-size tensors), so its blocks cost nothing and only
count tokens, and the scheduler gives it whole prompts (`ExecutorInfo.whole_prompts`): every
token attends to every other of its sequence, so a prompt cannot be cut into chunks. Nothing is
sampled: the step's output is its rows' final hidden states (`last_hidden`), which the runner
pools.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmbus.services.executor.attention.metadata import AttentionMetadata
from llmbus.services.executor.backends.torch_encoder import EncoderModel
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.weights.encoder_config import EncoderConfig
from llmbus.services.executor.weights.model_config import LlamaConfig

if TYPE_CHECKING:
    from llmbus.services.executor.lora.adapter_slots import StepAdapters

# Blocks of an encoder's (empty) cache: enough for this many prompts of the whole context.
ENCODER_SEQUENCES = 256


def bookkeeping_config(config: EncoderConfig) -> LlamaConfig:
    """What the runner reads of a model, for an encoder: its sizes, and a cache of no layers."""
    return LlamaConfig(
        num_layers=0, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_heads=config.num_heads,
        num_kv_heads=config.num_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
        rope_theta=config.rope_theta or 0.0, rms_norm_eps=config.layer_norm_eps,
        context_length=config.context_length, bos_token_id=None, eos_token_ids=(),
        tie_word_embeddings=False)


class EncoderBackend:
    """Backend over an EncoderModel: whole prompts in, hidden states out, no logits."""

    dtype = torch.float32
    device = torch.device("cpu")
    step_adapters: StepAdapters | None = None  # an encoder serves none (lora/backend_support.py)

    def __init__(self, model: EncoderModel) -> None:
        self.model = model
        self.encoder_config = model.config
        self.config = bookkeeping_config(model.config)
        self._hidden = torch.empty(0, model.config.hidden_size)

    @classmethod
    def load(cls, path: str | Path) -> EncoderBackend:
        return cls(EncoderModel.load(path))

    def set_max_positions(self, max_positions: int) -> None:
        """Nothing to size: positions restart in every prompt, up to the model's context."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Every sequence's whole prompt at once (ValueError for a chunk); no logits."""
        query_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
        if query_lens != meta.context_lens.tolist():
            raise ValueError("an encoder computes each prompt whole, in one step, not in "
                             "chunks")
        if logits_indices.numel():
            raise ValueError("an encoder samples nothing: it only embeds")
        self._hidden = self.model.forward(input_ids, query_lens)
        return torch.empty(0, self.config.vocab_size)

    def last_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """The last forward's rows: an encoder's final layer ends in its own norm."""
        return self._hidden[rows].float()

"""The one contract every backend implements: a forward over a flat batch and the paged KV cache.

A step is T tokens from B sequences (prefill chunks and decodes mixed); the runner builds the
attention metadata once per step and owns the cache. Implemented by backends/torch_llama.py's
`LlamaModel` (torch; Triton on CUDA) and backends/cpu_llama.py's `CpuLlamaModel` (the integer
kernel or ONNX Runtime); backend_choice.py picks one, backends/loading.py loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from llmbus.services.executor.attention.metadata import AttentionMetadata
    from llmbus.services.executor.kv_cache import KVCache
    from llmbus.services.executor.lora.adapter_slots import StepAdapters
    from llmbus.services.executor.weights.model_config import LlamaConfig


class Backend(Protocol):
    config: LlamaConfig
    dtype: torch.dtype  # of the activations it takes and the logits' source
    device: torch.device
    # The next forward's LoRA adapters (lora/adapter_slots.py; None: the base alone), which
    # the runner sets before each forward.
    step_adapters: StepAdapters | None
    def set_max_positions(self, max_positions: int) -> None:
        """Size the rotary tables for positions [0, max_positions)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logits_indices [S] -> float32 logits [S, V] of the rows
        that sample. Writes this step's K/V into `kv_cache` at `meta.slot_mapping`."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the residual stream [T, D] into the first layer. `forward` is
        embed_tokens, forward_layers, logits: a split model's lead shard
        (pipeline_lead.py) runs the three apart, the other shards' layers between."""

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, D] after the last layer; logits_indices [S] -> float32
        logits [S, V] of those rows (the final norm and the head)."""

    def forward_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata,
                       kv_cache: KVCache) -> torch.Tensor:
        """hidden [T, D], the residual stream into this model's first layer -> after its last:
        what a layer shard (layer_slice.py) computes. Writes this step's K/V."""

    def last_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [H] of the last forward's tokens -> float32 [H, D]: their final hidden states
        after the output norm (what an embedding pools; HF's `last_hidden_state`). Only
        between that forward and the next."""

"""A layer shard's pure core: some of a model's layers, their KV cache, and a step over them.

No NATS, no asyncio (layer_shard_bus.py is its bus side). The shard keeps no request state:
each step brings its geometry (query and context lengths, block tables) and its hidden states
from the lead shard, which owns the requests, the embedding and the sampling. The block ids
are the engine's (its scheduler's block table), so the shard's cache has as many blocks as
the lead's: the lead says how many (ShardSetup), once it has heard from every shard.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from llmbus.bus.messages import ShardInfo, ShardSetup, ShardStep
from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backend_choice import BackendChoice
from llmbus.services.executor.backends.loading import load_backend
from llmbus.services.executor.kv_cache import KVCache, bytes_per_block
from llmbus.services.executor.weights.layer_slice import (
    LayerSlice,
    model_layers,
    slice_file_bytes,
)
from llmbus.services.model_files import model_name_for


class LayerShard:
    """Layers [first, end) of the model at `model_path`; `setup` sizes the cache, `run`
    computes one step."""

    def __init__(self, model_path: str | Path, choice: BackendChoice, layers: LayerSlice,
                 num_threads: int, kv_budget_bytes: int) -> None:
        if choice.backend == "encoder":
            raise ValueError("an encoder (BERT's family) is not split into shards")
        if layers.has_vocab:
            raise ValueError("a layer shard holds layers only: the lead shard (0) embeds")
        torch.set_num_threads(num_threads)
        self.choice, self.layers = choice, layers
        self.device = torch.device(choice.device)
        self.model = load_backend(model_path, choice, self.device, num_threads, layers)
        self.kv_dtype = getattr(torch, choice.kv_dtype)
        self.kv_cache: KVCache | None = None
        self._info = ShardInfo(
            model_name=model_name_for(Path(model_path)),
            model_bytes=Path(model_path).stat().st_size,
            num_model_layers=model_layers(model_path), first_layer=layers.first,
            end_layer=layers.end, backend=choice.describe(), kv_dtype=choice.kv_dtype,
            kv_budget_bytes=kv_budget_bytes,
            kv_token_bytes=bytes_per_block(self.model.config, 1, self.kv_dtype),
            weight_bytes=slice_file_bytes(model_path, layers))

    def info(self) -> ShardInfo:
        """What this shard holds."""
        kv_bytes = 0 if self.kv_cache is None else self.kv_cache.k.nbytes * 2
        return msgspec.structs.replace(self._info, kv_bytes=kv_bytes)

    def setup(self, setup: ShardSetup) -> None:
        """The engine's KV geometry: a fresh cache (a restarted lead starts over)."""
        self.kv_cache = None  # the old one goes before the new one is made
        self.kv_cache = KVCache(self.model.config, setup.num_blocks, setup.block_size,
                                self.kv_dtype, self.device)
        self.model.set_max_positions(setup.max_model_len)

    def run(self, step: ShardStep, hidden: torch.Tensor) -> torch.Tensor:
        """The step's hidden states [T, D] through this shard's layers; writes their K/V."""
        if self.kv_cache is None:
            raise RuntimeError("no step before the lead's ShardSetup")
        for copy in step.copy_blocks:
            self.kv_cache.copy_block(copy.src, copy.dst)
        if not step.num_tokens:
            return hidden
        meta = build_attention_metadata(step.query_lens, step.context_lens, step.block_tables,
                                        self.kv_cache.block_size, self.device)
        with torch.inference_mode():
            return self.model.forward_layers(hidden.to(self.device), meta.positions, meta,
                                             self.kv_cache).cpu()


"""The physical paged KV cache: fixed-size blocks that the scheduler's block tables point into.

Block 0 is the null block: the scheduler never hands it out, and padding in block tables points
at it, so a padded gather always reads valid (zeroed or stale, but finite) memory.
"""

from __future__ import annotations

import os

import torch

from llmbus.services.executor.weights.model_config import LlamaConfig

DEFAULT_BUDGET_CAP_BYTES = 2 << 30
DEFAULT_BUDGET_FRACTION = 0.25
NULL_BLOCK_ID = 0


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages (no psutil)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budget_bytes(device: torch.device | str = "cpu") -> int:
    """CPU: a share of free RAM, capped. CUDA: half of the free device memory (the weights
    of the models served here are small next to it)."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(0.5 * free)
    return int(min(DEFAULT_BUDGET_CAP_BYTES, DEFAULT_BUDGET_FRACTION * available_memory_bytes()))


def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element_size
    return per_token * block_size


def num_blocks_for_budget(
    config: LlamaConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
) -> int:
    """How many blocks (the null block included) fit in `budget_bytes`; at least 2."""
    return max(2, budget_bytes // bytes_per_block(config, block_size, dtype))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeros whose pages the OS maps on first write, on the CPU: numpy's calloc gets fresh
    zero pages without touching them, so a cache sized for 32k tokens costs memory only for
    the blocks in use (torch.zeros writes every page up front)."""
    if torch.device(device).type != "cpu" or dtype == torch.bfloat16:
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    return torch.from_numpy(np.zeros(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))


class KVCache:
    """K and V for every layer: `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`.

    One tensor per K/V (not per layer) so a whole-cache operation (zeroing, moving, a block copy
    for copy-on-write) is one call; `layer(i)` returns views.
    """

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs the null block plus at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # zeros (not empty): padded gathers read the null block, and 0 * NaN would poison them.
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # each: [num_blocks, block_size, num_kv_heads, head_dim]
        return self.k[index], self.v[index]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block `dst` gets every layer's K and V of block `src`."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

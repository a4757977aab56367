"""The CPU backends' token embedding, looked up from the table as the file stores it."""

from __future__ import annotations

import torch

from llmbus.services.executor.weights.gguf_quants import QUANT_GROUP, NativeWeight, Q8_0Weight
from llmbus.services.executor.weights.k_quants import KQuantWeight
from llmbus.services.executor.weights.quant_parts import PackedRows


class TokenEmbedding:
    """Token rows from a quantized table (Q8_0: scale * code; Q4_0/Q4_1/Q4_K in Q4_1 form:
    scale * code + minimum, its codes packed two a byte where loaded for the integer kernel;
    the K-quants and IQ4 from the file's blocks, only the looked-up rows unpacked; as llama.cpp
    computes them) or a dense one."""

    def __init__(self, native: NativeWeight | PackedRows | None,
                 dense: torch.Tensor | None) -> None:
        self.native = native
        self.dense = dense if native is None else None
        if native is None and dense is None:
            raise ValueError("the embedding needs a quantized or a dense table")

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D] float32
        if self.dense is not None:
            return self.dense[ids]
        q = self.native
        if isinstance(q, PackedRows | KQuantWeight):
            return q.rows(ids)
        codes = q.codes[ids].view(len(ids), -1, QUANT_GROUP).float()  # [T, D/32, 32]
        rows = codes * q.scales[ids][..., None]
        if not isinstance(q, Q8_0Weight):
            rows = rows + q.minimums[ids][..., None]
        return rows.view(len(ids), -1)

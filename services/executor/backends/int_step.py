"""The fast mode's steps through every layer in llmbus's integer kernel (int_step.cpp).

Every step the kernel takes, from one stream's decode to a 2,048-token prompt chunk: the
matmuls on the GGUF's codes with integer activations, norms and SwiGLU, between the model's
attention calls, all on the OpenMP threads the attention uses. The layers are cut at the
attention as onnx_graphs.layer_graphs cuts them: L + 1 boundary calls, then the head.

Dense work of a decode step (bench/step_profile.py: layers and head, 2 Zen 4 cores, default
model): 16 sequences 13.5 ms, where ONNX Runtime's MatMulNBits graphs took 33.8; one sequence
3.6, where this kernel's earlier per-column form took 5.3. The 30 layers' matmuls alone at 16
tokens: 9.7 ms built for this CPU (VNNI), 15.2 built for plain AVX2. See int_step.cpp for why.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from llmbus.services.executor.attention.cpu_paged import KERNEL_MAX_QUERY_LEN, KV_DTYPES
from llmbus.services.executor.attention.metadata import AttentionMetadata
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.weights.k_quants import FORMATS
from llmbus.services.executor.weights.model_config import LlamaConfig
from llmbus.services.executor.weights.quant_parts import LayerParts, QuantPart

# 4-bit QKV projections take int16 activations in steps of any size (wide_rows=ALWAYS): int8
# ones there double the fast mode's perplexity cost (see IntStep).
ALWAYS = 1 << 62
_KINDS = {"q4": 1, "q8": 2, "kq": 3}
_MAX_PARTS = 3


class IntMatrix(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("pad", ctypes.c_int32), ("wide_rows", ctypes.c_int64),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("codes", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("sub_scales", ctypes.c_void_p), ("sub_mins", ctypes.c_void_p),
                ("high_codes", ctypes.c_void_p), ("format", ctypes.c_int32),
                ("pad2", ctypes.c_int32)]


class IntLinear(ctypes.Structure):
    _fields_ = [("parts", IntMatrix * _MAX_PARTS), ("num_parts", ctypes.c_int64)]

    @classmethod
    def of(cls, parts: list[QuantPart], wide_rows: int = 0) -> IntLinear:
        """The row-stack of `parts`; its 4-bit parts take int16 activations in steps of at most
        `wide_rows` tokens, int8 ones above. The parts' tensors must outlive it."""
        if not 1 <= len(parts) <= _MAX_PARTS:
            raise ValueError(f"{len(parts)} parts: an integer matmul takes 1 to {_MAX_PARTS}")
        linear = cls(num_parts=len(parts))
        for slot, q in zip(linear.parts[:len(parts)], parts, strict=True):
            slot.kind, slot.n, slot.k = _KINDS[q.kind], q.n, q.k
            slot.wide_rows = wide_rows if q.kind == "q4" else 0
            slot.codes, slot.scales = q.codes.data_ptr(), q.scales.data_ptr()
            slot.mins = q.mins.data_ptr() if q.mins is not None else None
            if q.kind == "kq":  # k_quant_tiles.h: its format says which of these it has
                slot.format = FORMATS[q.format].kernel_id
                for field in ("sub_scales", "sub_mins", "high_codes"):
                    tensor = getattr(q, field)
                    setattr(slot, field, None if tensor is None else tensor.data_ptr())
            elif q.sub_scales is not None:  # Q4_K kept factored
                slot.sub_scales, slot.sub_mins = q.sub_scales.data_ptr(), q.sub_mins.data_ptr()
        return linear


class IntBoundary(ctypes.Structure):
    _fields_ = [("o", IntLinear), ("gate_up", IntLinear), ("down", IntLinear),
                ("ffn_norm", ctypes.c_void_p), ("qkv", IntLinear),
                ("attn_norm", ctypes.c_void_p)]


def int_linear(lib: ctypes.CDLL, parts: list[QuantPart], x: torch.Tensor,
               wide_rows: int = 0, num_threads: int = 1) -> torch.Tensor:
    """x [T, K] float32 @ Wᵀ -> [T, sum N] in the kernel (one matmul, for tests)."""
    linear = IntLinear.of(parts, wide_rows)
    x = x.contiguous()
    y = torch.empty(x.shape[0], sum(q.n for q in parts))
    if lib.int_linear(ctypes.addressof(linear), x.data_ptr(), x.shape[0], y.data_ptr(), 0,
                      num_threads) != 0:
        raise RuntimeError(f"int_linear refused parts {[(q.kind, q.n, q.k) for q in parts]}")
    return y


class IntStep:
    """`layers(hidden, attend)`: every layer on hidden [T, D] -> the residual stream after the
    last layer; `head(rows)`: the final norm and vocab projection -> logits [S, V].

    `attend(layer, qkv)` is the model's attention of one layer, [T, (H + 2 Hkv) Dh] ->
    [T, H Dh].

    4-bit QKV projections take int16 activations, every other matmul int8 ones. Perplexity of
    the default model on tests/data (exact 16.525; ONNX Runtime's int8 graphs, float32 into
    QKV: 16.632): 16.554 (+0.17%) in steps of any size, on every x86-64-v3+ build; everything
    int8 16.583 (+0.35%). (Before Q4's minimums took d * sum(q), see int_step.cpp: +0.71%, and
    everything int8 +1.6%.)
    """

    def __init__(self, config: LlamaConfig, dense: dict[str, torch.Tensor],
                 layers: list[LayerParts], head: QuantPart | None, lib: ctypes.CDLL,
                 num_threads: int) -> None:
        """`head`: None in a layer shard (layer_slice.py), which has no head."""
        self.config, self.lib, self.num_threads = config, lib, num_threads
        names = [f"blk.{i}.{k}_norm.weight" for i in range(config.num_layers)
                 for k in ("attn", "ffn")]
        if head is not None:
            names.append("output_norm.weight")
        self._keep = [dense[n].float().contiguous() for n in names]
        norms = iter(t.data_ptr() for t in self._keep)
        self._layers, self._head_parts = layers, head  # the kernels read their memory
        self.boundaries = [IntBoundary() for _ in range(config.num_layers + 1)]
        for i, m in enumerate(layers):
            before, after = self.boundaries[i], self.boundaries[i + 1]
            before.attn_norm = next(norms)
            before.qkv = IntLinear.of(m["qkv"], wide_rows=ALWAYS)
            after.o, after.gate_up = IntLinear.of(m["o"]), IntLinear.of(m["gate_up"])
            after.down = IntLinear.of(m["down"])
            after.ffn_norm = next(norms)
        if head is not None:
            self.head_linear = IntLinear.of([head])
            self.output_norm = next(norms)
        self.qkv_width = sum(q.n for q in layers[0]["qkv"])
        self._boundary_table = (ctypes.c_void_p * len(self.boundaries))(
            *[ctypes.addressof(b) for b in self.boundaries])

    def layers(self, hidden: torch.Tensor, attend: Callable[[int, torch.Tensor], torch.Tensor],
               lora: int | None = None) -> torch.Tensor:
        """`lora`: the address of the step's adapters (lora/kernel_tables.LoraStep), or None."""
        cfg, lib = self.config, self.lib
        hidden = hidden.contiguous().clone()  # updated in place
        tokens = hidden.shape[0]
        qkv = torch.empty(tokens, self.qkv_width)
        attn = None
        for index, boundary in enumerate(self.boundaries):
            status = lib.int_boundary(ctypes.addressof(boundary), tokens, cfg.hidden_size,
                                      cfg.rms_norm_eps, hidden.data_ptr(),
                                      attn.data_ptr() if attn is not None else None,
                                      qkv.data_ptr(), self.num_threads, lora, index)
            if status != 0:
                raise RuntimeError(f"int_boundary {index} failed ({status})")
            if index < cfg.num_layers:
                attn = attend(index, qkv).contiguous()
        return hidden

    def layers_with_attention(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              kv_cache: KVCache, meta: AttentionMetadata, scale: float,
                              lora: int | None = None) -> torch.Tensor:
        """`layers` with every layer's attention in paged_attention.cpp, the whole loop one
        C++ call (step_layers.cpp), the same bits: for models without QKV bias, on steps whose
        queries the attention kernel takes whole (PagedAttention.takes_whole)."""
        cfg = self.config
        hidden = hidden.contiguous().clone()  # updated in place
        tokens, head_dim = hidden.shape[0], cfg.head_dim
        qkv = torch.empty(tokens, self.qkv_width)
        attn = torch.empty(tokens, cfg.num_heads * head_dim)
        q = torch.empty(tokens, cfg.num_heads, head_dim)
        cos, sin, tables = cos.contiguous(), sin.contiguous(), meta.block_tables
        k, v = kv_cache.k, kv_cache.v
        if k.dtype not in KV_DTYPES or v.dtype != k.dtype or not (
                k.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"expected a contiguous float32/float16 cache, got {k.dtype}")
        status = self.lib.int_step_layers(
            self._boundary_table, cfg.num_layers, tokens, cfg.hidden_size, cfg.rms_norm_eps,
            hidden.data_ptr(), attn.data_ptr(), qkv.data_ptr(), int(k.dtype == torch.float16),
            k.data_ptr(), v.data_ptr(), k.stride(0), cfg.num_heads, cfg.num_kv_heads, head_dim,
            cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(),
            tables.shape[1], meta.cu_seqlens_q.data_ptr(), meta.context_lens.data_ptr(),
            tables.shape[0], meta.block_size, KERNEL_MAX_QUERY_LEN, scale, q.data_ptr(), lora,
            self.num_threads)
        if status != 0:
            what = "boundary" if status < 2000 else "attention of layer"
            raise RuntimeError(f"int_step_layers: {what} {status % 1000} failed")
        return hidden

    def head(self, rows: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        assert self._head_parts is not None, "a layer shard has no head"
        rows = rows.contiguous()
        logits = torch.empty(rows.shape[0], self._head_parts.n)
        status = self.lib.int_head(ctypes.addressof(self.head_linear), self.output_norm,
                                   rows.shape[0], cfg.hidden_size, cfg.rms_norm_eps,
                                   rows.data_ptr(), logits.data_ptr(), self.num_threads)
        if status != 0:
            raise RuntimeError(f"int_head failed ({status})")
        return logits

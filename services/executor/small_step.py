"""Small steps (a few tokens) through every layer on the CPU kernels' own threads.

A one-token step streams every weight once and wants both cores; ONNX Runtime can give it only
one (see small_step.cpp). So in the fast mode, steps of up to `SMALL_STEP_TOKENS` tokens run
their matmuls in llmbus's kernel (int8 activations on the GGUF's codes, as ONNX Runtime's fast
path does), between the same attention calls, on the OpenMP threads the attention uses. The
layers are cut at the attention as onnx_graphs.layer_graphs cuts them: L + 1 boundary calls,
then the head.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from services.executor.gguf_loader import LlamaConfig
from services.executor.quant_parts import LayerParts, QuantPart

# Steps of at most this many tokens are small. Per step, 2 Zen 4 cores, decodes at ~100 tokens
# of context, this kernel against ONNX Runtime (single-threaded pools at 1 and 4 tokens, as
# before this kernel; two threads above): 1 token 6.1 against 10.9 ms, 4: 11.7 against 21.3,
# 8: 22 against 28, 12: 35 against 36, 16: 45 against 43 (±10% from run to run).
SMALL_STEP_TOKENS = 8
_KINDS = {"q4": 1, "q8": 2}
_MAX_PARTS = 3


class SmallMatrix(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("float_input", ctypes.c_int32),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("codes", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p)]


class SmallLinear(ctypes.Structure):
    _fields_ = [("parts", SmallMatrix * _MAX_PARTS), ("num_parts", ctypes.c_int64)]

    @classmethod
    def of(cls, parts: list[QuantPart], float_q4_input: bool = False) -> SmallLinear:
        """The row-stack of `parts` (int8 activations, or float32 ones into 4-bit parts with
        `float_q4_input`); the parts' tensors must outlive it."""
        if not 1 <= len(parts) <= _MAX_PARTS:
            raise ValueError(f"{len(parts)} parts: a small-step matmul takes 1 to {_MAX_PARTS}")
        linear = cls(num_parts=len(parts))
        for slot, q in zip(linear.parts[:len(parts)], parts, strict=True):
            slot.kind, slot.n, slot.k = _KINDS[q.kind], q.n, q.k
            slot.float_input = int(float_q4_input and q.kind == "q4")
            slot.codes, slot.scales = q.codes.data_ptr(), q.scales.data_ptr()
            slot.mins = q.mins.data_ptr() if q.mins is not None else None
        return linear


class SmallBoundary(ctypes.Structure):
    _fields_ = [("o", SmallLinear), ("gate_up", SmallLinear), ("down", SmallLinear),
                ("ffn_norm", ctypes.c_void_p), ("qkv", SmallLinear),
                ("attn_norm", ctypes.c_void_p)]


def small_linear(lib: ctypes.CDLL, parts: list[QuantPart], x: torch.Tensor,
                 float_q4_input: bool = False, num_threads: int = 1) -> torch.Tensor:
    """x [T, K] float32 @ Wᵀ -> [T, sum N] in the kernel (one matmul, for tests)."""
    linear = SmallLinear.of(parts, float_q4_input)
    x = x.contiguous()
    y = torch.empty(x.shape[0], sum(q.n for q in parts))
    if lib.small_linear(ctypes.addressof(linear), x.data_ptr(), x.shape[0], y.data_ptr(), 0,
                        num_threads) != 0:
        raise RuntimeError(f"small_linear refused parts {[(q.kind, q.n, q.k) for q in parts]}")
    return y


class SmallStep:
    """`layers(hidden, attend)`: every layer on hidden [T, D] -> the residual stream after the
    last layer; `head(rows)`: the final norm and vocab projection -> logits [S, V].

    `attend(layer, qkv)` is the model's attention of one layer, [T, (H + 2 Hkv) Dh] ->
    [T, H Dh].

    4-bit QKV and down projections take float32 activations, the rest int8 ones. Perplexity of
    the default model on tests/data (exact 16.525), float32 into QKV and int8 elsewhere: 16.665
    (+0.85%); into QKV and also O 16.614, gate/up 16.616, down 16.590 (+0.4%). In a one-token
    step the float32 down projection costs nothing measurable (memory-bound: 6.1 ms per step
    either way on 2 Zen 4 cores); at four tokens ~1 ms of 11.
    """

    def __init__(self, config: LlamaConfig, dense: dict[str, torch.Tensor],
                 layers: list[LayerParts], head: QuantPart, lib: ctypes.CDLL,
                 num_threads: int) -> None:
        self.config, self.lib, self.num_threads = config, lib, num_threads
        self._keep = [dense[n].float().contiguous() for n in
                      [f"blk.{i}.{k}_norm.weight" for i in range(config.num_layers)
                       for k in ("attn", "ffn")] + ["output_norm.weight"]]
        norms = iter(t.data_ptr() for t in self._keep)
        self._layers, self._head_parts = layers, head  # the kernels read their memory
        self.boundaries = [SmallBoundary() for _ in range(config.num_layers + 1)]
        for i, m in enumerate(layers):
            before, after = self.boundaries[i], self.boundaries[i + 1]
            before.attn_norm = next(norms)
            before.qkv = SmallLinear.of(m["qkv"], float_q4_input=True)
            after.o, after.gate_up = SmallLinear.of(m["o"]), SmallLinear.of(m["gate_up"])
            after.down = SmallLinear.of(m["down"], float_q4_input=True)
            after.ffn_norm = next(norms)
        self.head_linear = SmallLinear.of([head])
        self.output_norm = next(norms)
        self.qkv_width = sum(q.n for q in layers[0]["qkv"])

    def layers(self, hidden: torch.Tensor,
               attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        cfg, lib = self.config, self.lib
        hidden = hidden.contiguous().clone()  # updated in place
        tokens = hidden.shape[0]
        qkv = torch.empty(tokens, self.qkv_width)
        attn = None
        for index, boundary in enumerate(self.boundaries):
            status = lib.small_boundary(ctypes.addressof(boundary), tokens, cfg.hidden_size,
                                        cfg.rms_norm_eps, hidden.data_ptr(),
                                        attn.data_ptr() if attn is not None else None,
                                        qkv.data_ptr(), self.num_threads)
            if status != 0:
                raise RuntimeError(f"small_boundary {index} failed ({status})")
            if index < cfg.num_layers:
                attn = attend(index, qkv).contiguous()
        return hidden

    def head(self, rows: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        rows = rows.contiguous()
        logits = torch.empty(rows.shape[0], self._head_parts.n)
        status = self.lib.small_head(ctypes.addressof(self.head_linear), self.output_norm,
                                     rows.shape[0], cfg.hidden_size, cfg.rms_norm_eps,
                                     rows.data_ptr(), logits.data_ptr(), self.num_threads)
        if status != 0:
            raise RuntimeError(f"small_head failed ({status})")
        return logits

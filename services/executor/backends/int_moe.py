"""A mixture of experts (Qwen3-MoE) in the fast mode: every matmul in llmbus's integer kernel
on the GGUF's codes, experts included, none ever dequantized.

Per layer: the norm, QKV, the model's attention, O (added into the residual in the kernel),
the norm, then the router (float32: [E, D], a few KB) and, for each expert some token chose,
one gate-up and one down matmul on the tokens routed to it (backends/moe.py): a step reads each
expert it uses once, whatever the batch. The dense layers' boundary calls (int_step.py) fuse
norms and SwiGLU in C++; here those few elementwise ops run in torch between the kernel's
matmuls, one call per matrix.
"""

from __future__ import annotations

import ctypes

import torch

from llmbus.services.executor.backends.int_step import ALWAYS, IntLinear
from llmbus.services.executor.backends.moe import moe_mlp
from llmbus.services.executor.backends.torch_llama import TorchOps, rms_norm
from llmbus.services.executor.weights.matrices import expert_matrix
from llmbus.services.executor.weights.model_config import LlamaConfig
from llmbus.services.executor.weights.quant_parts import QuantPart


class IntMoeStep:
    """`layers(hidden, attend)` and `head(rows)`, as IntStep's, for a mixture of experts."""

    def __init__(self, config: LlamaConfig, dense: dict[str, torch.Tensor],
                 native: dict[str, QuantPart], lib: ctypes.CDLL, num_threads: int) -> None:
        """`native` holds every matrix tiled (tile_as_loaded), each expert's apart
        (`blk.{i}.ffn_gate_exps.{e}.weight`); they are taken out of it."""
        self.config, self.lib, self.num_threads = config, lib, num_threads

        def part(name: str) -> QuantPart:
            return QuantPart.of(native.pop(name))

        self._parts: list[QuantPart] = []  # the kernels read their memory: kept alive here
        self._layer_weights = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            qkv = [part(f"{p}attn_{n}.weight") for n in "qkv"]
            o = [part(f"{p}attn_output.weight")]
            gate_up = [[part(expert_matrix(f"{p}ffn_{n}_exps.weight", e)) for n in ("gate", "up")]
                       for e in range(config.num_experts)]
            down = [[part(expert_matrix(f"{p}ffn_down_exps.weight", e))]
                    for e in range(config.num_experts)]
            self._parts += [*qkv, *o, *(q for pair in gate_up for q in pair),
                            *(q for one in down for q in one)]
            self._layer_weights.append({
                "attn_norm": dense[f"{p}attn_norm.weight"].float(),
                "ffn_norm": dense[f"{p}ffn_norm.weight"].float(),
                "router": dense[f"{p}ffn_gate_inp.weight"].float(),
                "qkv": IntLinear.of(qkv, wide_rows=ALWAYS), "o": IntLinear.of(o),
                "gate_up": [IntLinear.of(pair) for pair in gate_up],
                "down": [IntLinear.of(one) for one in down]})
        self.qkv_width = sum(q.n for q in self._parts[:3])
        if config.has_vocab:  # a layer shard has no head (layer_slice.py)
            head = QuantPart.of(native["output.weight"])
            self._parts.append(head)
            self.head_linear, self.vocab_size = IntLinear.of([head]), head.n
            self._output_norm = dense["output_norm.weight"].float().contiguous()

    def _linear(self, linear: IntLinear, x: torch.Tensor, width: int,
                into: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ Wᵀ -> [T, width]; added into `into` when given."""
        x = x.contiguous()
        y = into if into is not None else torch.empty(x.shape[0], width)
        if self.lib.int_linear(ctypes.addressof(linear), x.data_ptr(), x.shape[0], y.data_ptr(),
                               int(into is not None), self.num_threads) != 0:
            raise RuntimeError("int_linear refused a matrix of the mixture of experts")
        return y

    def layers(self, hidden: torch.Tensor, attend) -> torch.Tensor:
        """hidden [T, D] -> the residual stream after the last layer; `attend(layer, qkv)`."""
        cfg, eps = self.config, self.config.rms_norm_eps
        hidden = hidden.contiguous().clone()  # updated in place
        d, f = cfg.hidden_size, cfg.expert_intermediate_size
        for index, layer in enumerate(self._layer_weights):
            qkv = self._linear(layer["qkv"], rms_norm(hidden, layer["attn_norm"], eps),
                               self.qkv_width)
            self._linear(layer["o"], attend(index, qkv), d, into=hidden)

            def expert(e: int, rows: torch.Tensor, layer=layer) -> torch.Tensor:
                gate_up = self._linear(layer["gate_up"][e], rows, 2 * f)
                return self._linear(layer["down"][e], TorchOps.silu_mul(gate_up), d)

            hidden += moe_mlp(rms_norm(hidden, layer["ffn_norm"], eps), layer["router"],
                              expert, cfg.num_experts_used)
        return hidden

    def head(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [S, D] -> logits [S, V]: the final norm and the vocabulary head."""
        rows = rows.contiguous()
        logits = torch.empty(rows.shape[0], self.vocab_size)
        if self.lib.int_head(ctypes.addressof(self.head_linear), self._output_norm.data_ptr(),
                             rows.shape[0], self.config.hidden_size, self.config.rms_norm_eps,
                             rows.data_ptr(), logits.data_ptr(), self.num_threads) != 0:
            raise RuntimeError("int_head failed")
        return logits

"""The torch backend: Llama in plain torch (dense weights) over a flat batch and the paged
KV cache. It is the reference every other backend is checked against, and the CUDA path, where
`TritonOps` (kernels/triton/ops.py) fuses the non-matmul ops.

A step is one flat token stream: T tokens from B sequences, each a prefill chunk or a decode
token. Shapes below use T (tokens in the step), D (hidden), H / Hkv (query / KV heads),
Dh (head dim), S (sequences that sample), V (vocab).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from llmbus.services.executor.attention.metadata import AttentionMetadata
from llmbus.services.executor.attention.qk_norm import qk_rms_norm
from llmbus.services.executor.attention.rope import rope_tables
from llmbus.services.executor.attention.torch_paged import paged_attention, rope_write_kv
from llmbus.services.executor.backends.moe import moe_mlp
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.weights.gguf_loader import qk_norm_weights, qkv_bias
from llmbus.services.executor.weights.model_config import LlamaConfig

if TYPE_CHECKING:
    from llmbus.services.executor.lora.adapter_slots import StepAdapters


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in float32 as HF does, so bf16 runs stay close to the float32 reference.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU as Gemma computes it: tanh-approximated GELU of the gate times up."""
    gate, up = gate_up.chunk(2, dim=-1)  # each [T, F]
    return F.gelu(gate, approximate="tanh") * up


class TorchOps:
    """The non-matmul ops in plain torch, unfused (the CPU path of this backend).

    `kernels.triton.ops.TritonOps` has the same calls, each one fused Triton kernel (CUDA).
    """

    name = "torch"

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); x None adds nothing."""
        if x is not None:
            residual = residual + x
        return rms_norm(residual, weight, eps), residual

    rope_write_kv = staticmethod(rope_write_kv)
    attention = staticmethod(paged_attention)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, F]
        return F.silu(gate) * up


def select_ops(kernels: str | None, device: torch.device):
    """None picks by device: Triton kernels on CUDA, torch elsewhere."""
    if kernels is None:
        kernels = "triton" if device.type == "cuda" else "torch"
    if kernels == "torch":
        return TorchOps
    if kernels == "triton":
        from llmbus.services.executor.kernels.triton.ops import TritonOps  # imports triton

        return TritonOps
    raise ValueError(f"unknown kernels {kernels!r}: expected 'torch' or 'triton'")


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2 Hkv) * Dh, D], Q/K/V fused: one matmul instead of three
    attn_output: torch.Tensor  # [D, H * Dh]
    ffn_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 F, D], gate and up fused
    down: torch.Tensor  # [D, F]
    qkv_bias: torch.Tensor | None = None  # [(H + 2 Hkv) * Dh] (qwen2)
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # Q's and K's, [Dh] each (qwen3)
    # Gemma 3: norms of the attention's and the MLP's outputs [D], the layer's window
    post_attention_norm: torch.Tensor | None = None
    post_ffw_norm: torch.Tensor | None = None
    window: int = 0
    # A mixture of experts (Qwen3-MoE): the router [E, D] and each expert's gate_up [E, 2F, D]
    # and down [E, D, F]; gate_up and down above are then empty.
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None


class LlamaModel:
    """Weights plus the forward; the KV cache is passed in (the runner owns it).

    `linear(x, weight)` is every matmul of the forward; tests give an instance one that
    quantizes x first, to emulate the integer kernel's arithmetic in torch.

    `weights` are the file's tensors dequantized (gguf_loader), converted to `dtype`.
    `kernels` picks the backend of the non-matmul ops ("torch" or "triton"; None: by device).
    """

    linear = staticmethod(F.linear)

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], *,
                 max_positions: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kernels: str | None = None) -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.ops = select_ops(kernels, self.device)
        self._residual: torch.Tensor = torch.empty(0)  # the last forward's (last_hidden)
        self._delta: torch.Tensor | None = None
        self.step_adapters: StepAdapters | None = None  # the runner's, for the next forward

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def stacked(*names: str) -> torch.Tensor:
            """The row-stack of the weights `names`: one matmul for all of them."""
            return torch.cat([w(n) for n in names])

        def mlp(p: str) -> dict[str, torch.Tensor]:
            if config.num_experts:
                return {"gate_up": torch.empty(0), "down": torch.empty(0),
                        "router": w(p + "ffn_gate_inp.weight"),
                        "experts_gate_up": torch.cat([w(p + "ffn_gate_exps.weight"),
                                                      w(p + "ffn_up_exps.weight")], dim=1),
                        "experts_down": w(p + "ffn_down_exps.weight")}
            return {"gate_up": stacked(p + "ffn_gate.weight", p + "ffn_up.weight"),
                    "down": stacked(p + "ffn_down.weight")}

        self.layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            self.layers.append(_Layer(
                attn_norm=w(p + "attn_norm.weight"),
                qkv=stacked(*(p + f"attn_{n}.weight" for n in "qkv")),
                attn_output=stacked(p + "attn_output.weight"),
                ffn_norm=w(p + "ffn_norm.weight"), **mlp(p),
                qkv_bias=None if qkv_bias(weights, i) is None
                else qkv_bias(weights, i).to(device=device, dtype=dtype),
                qk_norm=None if qk_norm_weights(weights, i) is None
                else tuple(t.to(device=device, dtype=dtype)
                           for t in qk_norm_weights(weights, i)),
                post_attention_norm=w(p + "post_attention_norm.weight")
                if config.post_norms else None,
                post_ffw_norm=w(p + "post_ffw_norm.weight") if config.post_norms else None,
                window=config.window(i)))
        if config.has_vocab:  # a layer shard has none of these (layer_slice.py)
            self.embed = w("token_embd.weight")  # [V, D]
            self.lm_head = (self.embed if config.tie_word_embeddings
                            else w("output.weight"))  # [V, D]
            self.output_norm = w("output_norm.weight")
        self.set_max_positions(max_positions)
        self.scale = config.scale

    def set_max_positions(self, max_positions: int) -> None:
        """Size the rotary tables for positions [0, max_positions): the global layers', and
        the local layers' where they have their own (Gemma 3)."""
        tables = [rope_tables(self.config, max_positions, local)
                  for local in (False, True)[:1 + (self.config.local_rope_theta is not None)]]
        self.rope = [(cos.to(self.device, self.dtype), sin.to(self.device, self.dtype))
                     for cos, sin in tables]

    def _expert(self, layer: _Layer, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU MLP on the rows routed to it: [n, D] -> [n, D]."""
        gate_up = self.linear(rows, layer.experts_gate_up[expert])  # [n, 2F]
        return self.linear(self.ops.silu_mul(gate_up), layer.experts_down[expert])

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer on the residual stream h [T, D] -> (h, delta): the stream after the last
        layer is h + delta, added inside the next norm (one fused kernel)."""
        cfg, ops, eps = self.config, self.ops, self.config.rms_norm_eps
        rope = [(cos[positions], sin[positions]) for cos, sin in self.rope]  # [T, Dh] each
        delta: torch.Tensor | None = None  # [T, D]
        adapters = self.step_adapters
        for index, layer in enumerate(self.layers):
            cos, sin = rope[cfg.local_rope(index)]
            x, h = ops.add_rms_norm(h, delta, layer.attn_norm, eps)
            qkv = self.linear(x, layer.qkv)  # [T, (H + 2 Hkv) * Dh]
            if adapters is not None:
                self._add_qkv_deltas(adapters, index, x, qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            if layer.qk_norm is not None:
                qkv = qk_rms_norm(qkv, *layer.qk_norm, cfg.num_heads, cfg.num_kv_heads, eps)
            k_cache, v_cache = kv_cache.layer(index)
            q = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                  cfg.num_heads)  # [T, H, Dh]
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale,
                                 layer.window)  # [T, H * Dh]
            out = self.linear(attn, layer.attn_output)  # [T, D]
            if adapters is not None:
                adapters.add(index, "o", attn, out)
            if layer.post_attention_norm is not None:
                out = rms_norm(out, layer.post_attention_norm, eps)
            x, h = ops.add_rms_norm(h, out, layer.ffn_norm, eps)
            if layer.router is not None:
                delta = moe_mlp(x, layer.router, partial(self._expert, layer),
                                cfg.num_experts_used)
            else:
                gate_up = self.linear(x, layer.gate_up)  # [T, 2F]
                if adapters is not None:
                    adapters.add(index, "gate", x, gate_up)
                    adapters.add(index, "up", x, gate_up, gate_up.shape[1] // 2)
                act = gelu_mul(gate_up) if cfg.gelu else ops.silu_mul(gate_up)
                delta = self.linear(act, layer.down)
                if adapters is not None:
                    adapters.add(index, "down", act, delta)
            if layer.post_ffw_norm is not None:
                delta = rms_norm(delta, layer.post_ffw_norm, eps)
        return h, delta

    def _add_qkv_deltas(self, adapters: StepAdapters, index: int, x: torch.Tensor,
                        qkv: torch.Tensor) -> None:
        """LoRA deltas of Q, K and V into their columns of the stacked projection."""
        cfg = self.config
        widths = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        for target, column in zip("qkv", (0, widths[0], widths[0] + widths[1]), strict=True):
            adapters.add(index, target, x, qkv, column)

    def forward_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata,
                       kv_cache: KVCache) -> torch.Tensor:
        """hidden [T, D], the residual stream into this model's first layer -> after its last
        (Backend.forward_layers)."""
        h, delta = self._layers(hidden, positions, meta, kv_cache)
        return h if delta is None else h + delta

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logits_indices [S] -> float32 logits [S, V].

        Writes this step's K/V into `kv_cache` at `meta.slot_mapping`.
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        h, delta = self._layers(self.embed_tokens(input_ids), positions, meta, kv_cache)
        self._residual, self._delta = h, delta  # for last_hidden
        # Only the positions that sample pay for the norm and the vocab projection.
        tail = None if delta is None else delta[logits_indices]
        h, _ = ops.add_rms_norm(h[logits_indices], tail, self.output_norm, eps)  # [S, D]
        return self.linear(h, self.lm_head).float()  # [S, V]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the residual stream [T, D] into the first layer (Backend)."""
        h = self.embed[input_ids]
        if self.config.embedding_scale != 1.0:
            h = h * torch.tensor(self.config.embedding_scale, dtype=h.dtype)
        return h

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, D] after the last layer; logits_indices [S] -> float32
        logits [S, V] (Backend); `forward`'s head, on a stream whole already."""
        self._residual, self._delta = hidden, None
        h, _ = self.ops.add_rms_norm(hidden[logits_indices], None, self.output_norm,
                                     self.config.rms_norm_eps)
        return self.linear(h, self.lm_head).float()

    def last_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """The last forward's rows after the output norm, in float32 (Backend.last_hidden)."""
        tail = None if self._delta is None else self._delta[rows]
        h, _ = self.ops.add_rms_norm(self._residual[rows], tail, self.output_norm,
                                     self.config.rms_norm_eps)
        return h.float()

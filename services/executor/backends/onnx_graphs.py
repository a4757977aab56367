"""ONNX graphs of a Llama model's dense work, with the GGUF's quantized weights kept quantized.

The model is cut at its attention: llmbus's paged attention (cpu_llama.py) runs between them,
and each graph runs everything from one attention to the next. Graph `i` (0 < i < L) is

    o = attn @ Wo[i-1];  x, h = skip_rms_norm(o, h, ffn_norm[i-1])
    d = (silu(x @ Wgate) * (x @ Wup)) @ Wdown;  x, h = skip_rms_norm(d, h, attn_norm[i])
    qkv = x @ Wqkv[i]                                  -> outputs h [T, D], qkv [T, (H+2Hkv)Dh]

graph 0 is only the first norm and QKV, graph L ends with the residual after the last FFN, and
a head graph takes the rows that sample through the final norm and the vocab projection. One
step is then L + 2 ONNX Runtime calls.

Matmuls are ONNX Runtime's `MatMulNBits` (MLAS kernels chosen at run time for AVX2, AVX-512,
VNNI or AMX) on the GGUF's own codes:

- Q4_1 (weight = d * code + m, Q4_0 arrives in this form with m = -8 d): 4-bit codes with zero
  point 0, plus the minimums' share, (per-block sums of x) @ Mᵀ, a [T, K/32] @ [K/32, N] matmul.
  Float zero points would express m directly but run ~10× slower in MLAS.
- Q8_0 (weight = d * code): 8-bit codes shifted by 128 with uint8 zero points of 128 on the
  fast path; the exact path multiplies its dequantized values (MLAS's float32 8-bit path is
  ~40× slower than a dense MatMul).
- Anything else (F32/F16 files, other quant types) as a plain float32 MatMul.

`accuracy_level` 0 computes in float32 on weights equal to the GGUF's values (the exact path);
4 quantizes activations to int8 per block, as llama.cpp does (the fast path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from llmbus.services.executor.weights.gguf_quants import QUANT_GROUP, Q4_1Weight, Q8_0Weight
from llmbus.services.executor.weights.model_config import LlamaConfig

OPSET = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
FLOAT = TensorProto.FLOAT


@dataclass
class MatrixSource:
    """One GGUF matrix [out, in]: its native quantized form if it has one, else dense."""

    native: Q4_1Weight | Q8_0Weight | None
    dense: np.ndarray | None  # float32 [out, in], only when `native` is None


class _GraphBuilder:
    """Collects nodes and initializers of one graph; names are made unique by a counter."""

    def __init__(self, accuracy_level: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.accuracy_level = accuracy_level
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def const(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, *,
           domain: str = "", outputs: list[str] | None = None, **attrs) -> list[str]:
        outputs = outputs or [self.name(op_type.lower()) for _ in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, domain=domain, **attrs))
        return outputs

    def rms_norm(self, x: str, weight: np.ndarray, eps: float) -> str:
        return self.op("SimplifiedLayerNormalization", [x, self.const("norm", weight)],
                       axis=-1, epsilon=eps, stash_type=1)[0]

    def gelu_tanh(self, x: str) -> str:
        """GELU, tanh-approximated as Gemma's `gelu_pytorch_tanh`:
        0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
        def const(value: float) -> str:
            return self.const("c", np.array(value, dtype=np.float32))

        cube = self.op("Mul", [self.op("Mul", [x, x])[0], x])[0]
        inner = self.op("Add", [x, self.op("Mul", [cube, const(0.044715)])[0]])[0]
        tanh = self.op("Tanh", [self.op("Mul", [inner, const(math.sqrt(2 / math.pi))])[0]])[0]
        half_x = self.op("Mul", [x, const(0.5)])[0]
        return self.op("Mul", [half_x, self.op("Add", [tanh, const(1.0)])[0]])[0]

    def skip_rms_norm(self, x: str, residual: str, weight: np.ndarray,
                      eps: float) -> tuple[str, str]:
        """(rms_norm(x + residual), x + residual)."""
        normed, total = self.name("normed"), self.name("residual")
        # Outputs 1 and 2 (mean, inverse std) are not needed.
        self.op("SkipSimplifiedLayerNormalization", [x, residual, self.const("norm", weight)],
                domain="com.microsoft", outputs=[normed, "", "", total], epsilon=eps)
        return normed, total

    def linear(self, x: str, parts: list[MatrixSource], q4_accuracy_level: int | None = None
               ) -> str:
        """x [T, K] @ Wᵀ for W the row-stack of `parts`: one matmul per run of same-format
        parts, outputs concatenated. 4-bit runs take `q4_accuracy_level` if given (8-bit ones
        keep the graph's: MLAS's float32 8-bit path is ~40× slower, and the exact mode's dense
        stand-in would quadruple their memory)."""
        runs: list[list[MatrixSource]] = []
        for part in parts:
            if runs and _kind(runs[-1][0]) == _kind(part):
                runs[-1].append(part)
            else:
                runs.append([part])
        outs = [self._matmul(x, run, q4_accuracy_level
                             if q4_accuracy_level is not None and _kind(run[0]) == "q4_1"
                             else self.accuracy_level) for run in runs]
        return outs[0] if len(outs) == 1 else self.op("Concat", outs, axis=-1)[0]

    def _matmul(self, x: str, run: list[MatrixSource], level: int) -> str:
        kind = _kind(run[0])
        if kind == "dense":
            w = np.concatenate([p.dense for p in run])  # [N, K]
            return self.op("MatMul", [x, self.const("w", w.T.astype(np.float32))])[0]
        if kind == "q8_0" and level == 0:
            # MLAS has no fast float32 path for 8-bit weights (110 ms for a 49152 x 576 head,
            # against 2.6 ms dense): the exact path multiplies the dequantized values.
            w = np.concatenate([p.native.dequantize().numpy() for p in run])  # [N, K]
            return self.op("MatMul", [x, self.const("w", w.T.copy())])[0]
        if kind == "q8_0":
            codes = np.concatenate([p.native.codes.numpy() for p in run])  # [N, K] int8
            scales = np.concatenate([p.native.scales.numpy() for p in run])  # [N, K/32]
            blobs = (codes.astype(np.int16) + 128).astype(np.uint8)
            zero_points = np.full(scales.shape, 128, dtype=np.uint8)
            return self._matmul_nbits(x, blobs, scales, zero_points, 8, level)
        codes = np.concatenate([p.native.codes.numpy() for p in run])  # [N, K] uint8 0..15
        scales = np.concatenate([p.native.scales.numpy() for p in run])  # [N, K/32]
        minimums = np.concatenate([p.native.minimums.numpy() for p in run])  # [N, K/32]
        blobs = codes[:, 0::2] | (codes[:, 1::2] << 4)  # MatMulNBits: even inputs low nibble
        zero_points = np.zeros((scales.shape[0], -(-scales.shape[1] // 2)), dtype=np.uint8)
        y = self._matmul_nbits(x, blobs, scales, zero_points, 4, level)
        # The minimums' share: sum_k m[n, k // 32] x[k] = (block sums of x) @ Mᵀ
        blocks = self.op("Reshape", [x, self.const("shape", np.array([0, -1, QUANT_GROUP]))])
        sums = self.op("ReduceSum", [blocks[0], self.const("axes", np.array([-1]))],
                       keepdims=0)[0]  # [T, K/32]
        share = self.op("MatMul", [sums, self.const("minimums", minimums.T.copy())])[0]
        return self.op("Add", [y, share])[0]

    def _matmul_nbits(self, x: str, blobs: np.ndarray, scales: np.ndarray,
                      zero_points: np.ndarray, bits: int, level: int) -> str:
        n, k = scales.shape[0], scales.shape[1] * QUANT_GROUP
        blob_bytes = QUANT_GROUP * bits // 8
        inputs = [x, self.const("codes", blobs.reshape(n, k // QUANT_GROUP, blob_bytes)),
                  self.const("scales", scales.astype(np.float32).reshape(-1)),
                  self.const("zero_points", zero_points.reshape(-1))]
        return self.op("MatMulNBits", inputs, domain="com.microsoft", K=k, N=n, bits=bits,
                       block_size=QUANT_GROUP, accuracy_level=level)[0]

    def model(self, name: str, inputs: list[tuple[str, int]], outputs: dict[str, tuple[str, int]]
              ) -> onnx.ModelProto:
        """`inputs`: (name, width) of [T, width] float32 inputs; `outputs`: graph output name
        -> (value to output, width)."""
        for out_name, (value, _) in outputs.items():
            self.nodes.append(helper.make_node("Identity", [value], [out_name]))
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info(n, FLOAT, ["T", w]) for n, w in inputs],
            [helper.make_tensor_value_info(n, FLOAT, ["T", w]) for n, (_, w) in outputs.items()],
            self.initializers)
        return helper.make_model(graph, opset_imports=OPSET, ir_version=10)


def _kind(source: MatrixSource) -> str:
    if isinstance(source.native, Q8_0Weight):
        return "q8_0"
    if isinstance(source.native, Q4_1Weight):
        return "q4_1"
    return "dense"


def layer_graphs(config: LlamaConfig, matrices: dict[str, MatrixSource],
                 norms: dict[str, np.ndarray], accuracy_level: int,
                 qkv_q4_accuracy_level: int | None = None) -> list[onnx.ModelProto]:
    """The L + 1 graphs between attentions (see the module doc), in order.

    Inputs: `hidden` [T, D] (the residual stream), and `attn` [T, H * Dh] except in graph 0.
    Outputs: `qkv` [T, (H + 2 Hkv) * Dh] except in graph L; `hidden_out` [T, D] except in
    graph 0 (whose residual is its input).
    """
    d, eps = config.hidden_size, config.rms_norm_eps
    qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    attn_width = config.num_heads * config.head_dim
    graphs = []
    for i in range(config.num_layers + 1):
        g = _GraphBuilder(accuracy_level)
        inputs, outputs = [("hidden", d)], {}
        x, hidden = None, "hidden"
        if i > 0:
            p = f"blk.{i - 1}."
            inputs.append(("attn", attn_width))
            o = g.linear("attn", [matrices[p + "attn_output.weight"]])
            if config.post_norms:  # Gemma 3: the attention's output is normalised first
                o = g.rms_norm(o, norms[p + "post_attention_norm.weight"], eps)
            x, hidden = g.skip_rms_norm(o, hidden, norms[p + "ffn_norm.weight"], eps)
            gate_up = g.linear(x, [matrices[p + "ffn_gate.weight"], matrices[p + "ffn_up.weight"]])
            gate, up = g.op("Split", [gate_up], 2, axis=-1)
            act = g.op("Mul", [g.gelu_tanh(gate) if config.gelu else
                               g.op("Mul", [gate, g.op("Sigmoid", [gate])[0]])[0], up])[0]
            down = g.linear(act, [matrices[p + "ffn_down.weight"]])
            if config.post_norms:
                down = g.rms_norm(down, norms[p + "post_ffw_norm.weight"], eps)
            if i == config.num_layers:
                outputs["hidden_out"] = (g.op("Add", [down, hidden])[0], d)
            else:
                x, hidden = g.skip_rms_norm(down, hidden, norms[f"blk.{i}.attn_norm.weight"],
                                            eps)
                outputs["hidden_out"] = (hidden, d)
        elif config.layer_offset:  # a layer shard (layer_slice.py): the fused norm with
            # nothing to add, bit for bit the norm of the whole model's graph at this layer
            nothing = g.op("Mul", [hidden, g.const("zero", np.zeros((), np.float32))])[0]
            x, _ = g.skip_rms_norm(nothing, hidden, norms["blk.0.attn_norm.weight"], eps)
        else:
            x = g.rms_norm(hidden, norms["blk.0.attn_norm.weight"], eps)
        if i < config.num_layers:
            p = f"blk.{i}."
            qkv = g.linear(x, [matrices[p + f"attn_{n}.weight"] for n in "qkv"],
                           qkv_q4_accuracy_level)
            outputs["qkv"] = (qkv, qkv_width)
        graphs.append(g.model(f"layer_boundary_{i}", inputs, outputs))
    return graphs


def head_graph(config: LlamaConfig, head: MatrixSource, output_norm: np.ndarray,
               accuracy_level: int) -> onnx.ModelProto:
    """`hidden` [S, D] (the residual rows that sample) -> `logits` [S, V]: norm, vocab head."""
    g = _GraphBuilder(accuracy_level)
    x = g.rms_norm("hidden", output_norm, config.rms_norm_eps)
    return g.model("head", [("hidden", config.hidden_size)],
                   {"logits": (g.linear(x, [head]), config.vocab_size)})

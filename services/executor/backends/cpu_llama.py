# Over 300 lines: one model whose two dense paths (the integer kernel, ONNX Runtime's graphs)
# share its embedding, attention and head, for every family the CPU backends take.
"""The CPU backends: llmbus's integer kernel, or ONNX Runtime's graphs, with paged attention.

Same contract as every backend (backend.Backend), so the runner drives either. Per step: embed the
tokens (from the GGUF's own codes), then for each layer do the dense work up to its QKV, write
RoPE'd K/V into the paged cache and attend (llmbus's C++ kernel, attention/cpu_paged.py; the
torch reference where no compiler built it), and hand the attention output to the next layer's
dense work; last, the head on the rows that sample.

The dense work runs in one of two places (backend_choice.py decides which, once):
- the integer kernel (int_step.py): the fast mode wherever the kernels were built and take the
  file; every step, on the attention's OpenMP threads, and no ONNX Runtime session at all;
- ONNX Runtime graphs built from the GGUF (onnx_graphs.py): the exact mode (float32
  activations), and the fast mode (int8 ones) without a compiler or for a file with matrices
  the kernel does not take. Weights stay quantized (MatMulNBits); inputs and outputs are bound
  to torch tensors' memory (IOBinding), so nothing is copied. Every graph has a session with
  the executor's threads, whose pool never spins (see `_session`), and a single-threaded twin
  for steps of a few tokens, where waking a pool thread 31 times a step costs more than it
  gains.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import torch

from llmbus.services.executor.attention.cpu_paged import PagedAttention
from llmbus.services.executor.attention.metadata import AttentionMetadata
from llmbus.services.executor.attention.qk_norm import qk_rms_norm
from llmbus.services.executor.attention.rope import rope_tables
from llmbus.services.executor.attention.torch_paged import paged_attention, rope_write_kv
from llmbus.services.executor.backends.int_moe import IntMoeStep
from llmbus.services.executor.backends.int_step import IntStep
from llmbus.services.executor.backends.token_embedding import TokenEmbedding
from llmbus.services.executor.backends.torch_llama import rms_norm
from llmbus.services.executor.kernels.cpu.library import load_library
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.weights.gguf_loader import qk_norm_weights, qkv_bias
from llmbus.services.executor.weights.gguf_quants import (
    NativeWeight,
    requantize_q8_0,
)
from llmbus.services.executor.weights.k_quants import KQuantWeight
from llmbus.services.executor.weights.matrices import LAYER_MATRICES
from llmbus.services.executor.weights.model_config import LlamaConfig
from llmbus.services.executor.weights.quant_parts import (
    PackedRows,
    QuantPart,
    kernel_takes,
    layer_parts,
)

if TYPE_CHECKING:
    from llmbus.services.executor.lora.adapter_slots import StepAdapters

ACCURACY_EXACT = 0  # float32 activations: the weights are the GGUF's values, the exact path
ACCURACY_FAST = 4  # int8 activations per block, like llama.cpp's
SINGLE_THREAD_TOKENS = 4  # in ONNX Runtime's graphs, steps this small run on one thread
# In the graphs, a 4-bit QKV projection always takes float32 activations (the integer
# kernel: int16 ones): int8 ones there cost most of the fast mode's perplexity (default model,
# tests/data text: exact 16.525; everything int8 16.783, +1.6%; QKV float32, the rest int8
# 16.573, +0.3%, when first measured; 16.632, +0.65%, with today's float16 cache and attention
# kernel) for ~1.4 of ~12 ms of a one-token step.
# (8-bit weights keep int8 activations: see onnx_graphs.linear.)


def _session(model_bytes: bytes, num_threads: int) -> ort.InferenceSession:
    """A session with its own pool of `num_threads` (the caller included) that never spins.

    Between two graphs the attention kernel's OpenMP threads take the cores; a pool thread
    spinning after its run would keep one of them (measured on 2 cores, 16 decodes at 300
    tokens: attention 44 ms per step beside a spinning pool, 26 ms beside this one).
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # No arena: a big prefill step's intermediates (tens of MB) go back to the OS afterwards
    # instead of staying reserved in the arena of every session that ran one.
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _sessions(models: list[bytes], num_threads: int) -> list[_Graph]:
    return [_Graph(_session(m, num_threads)) for m in models]


def _return_freed_memory() -> None:
    """Building the graphs frees ~0.5 GB of temporaries (protobufs, packed codes) that glibc
    would keep in the heap; hand it back to the OS (a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _integer_step(config: LlamaConfig, dense: dict[str, torch.Tensor],
                  native: dict[str, NativeWeight], lib: ctypes.CDLL, num_threads: int,
                  release: bool) -> IntStep:
    """The integer kernel's layers and head (none in a layer shard: layer_slice.py); with
    `release`, each matrix leaves `native` once tiled."""
    parts = layer_parts(config, native, release)
    head = None
    if config.has_vocab:
        untied = release and native.get("output.weight") is not native.get(
            "token_embd.weight")  # the embedding keeps a tied table
        head = QuantPart.of(native.pop("output.weight") if untied else native["output.weight"])
    return IntStep(config, dense, parts, head, lib, num_threads)


class _Graph:
    """One session and its reusable binding; `run` binds torch tensors in place."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session
        self.binding = session.io_binding()
        self.output_widths = {o.name: o.shape[1] for o in session.get_outputs()}

    def run(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        b = self.binding
        for name, t in inputs.items():
            b.bind_input(name, "cpu", 0, np.float32, tuple(t.shape), t.data_ptr())
        for name, t in outputs.items():
            b.bind_output(name, "cpu", 0, np.float32, tuple(t.shape), t.data_ptr())
        self.session.run_with_iobinding(b)


class CpuLlamaModel:
    """Weights in the integer kernel's tiles or ONNX Runtime sessions, plus the forward; the
    KV cache is passed in.

    `native` holds the quantized matrices by GGUF name, `dense` every other tensor (norms,
    and matrices without a native form), float32 in HF layout (see gguf_loader).
    """

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, config: LlamaConfig, dense: dict[str, torch.Tensor],
                 native: dict[str, NativeWeight], *, max_positions: int, exact: bool = False,
                 integer_kernel: bool | None = None, isa: str | None = None,
                 num_threads: int = 1, release_native: bool = False) -> None:
        """`integer_kernel`: the fast mode's dense work in the integer kernel (None: wherever
        it runs; True: it must, else ValueError; never in the exact mode). `isa`: the CPU
        kernels' build (kernels/cpu/library.py; None: LLMBUS_CPU_ISA, else native).
        `release_native`: the model may take the matrices it tiles out of `native` as it goes
        (the caller has no further use)."""
        self.config, self.exact = config, exact
        self.accuracy_level = ACCURACY_EXACT if exact else ACCURACY_FAST
        lib = load_library(isa)  # None without a C++ compiler: torch attention then
        self.paged_attention = PagedAttention(lib, num_threads) if lib else None
        takes = not exact and lib is not None and kernel_takes(config, native)
        if integer_kernel and not takes:
            raise ValueError("the integer kernel cannot run here: "
                             + ("it has no exact mode" if exact else
                                "no C++ compiler built it" if lib is None else
                                "the file has matrices it does not take"))
        integer_kernel = takes if integer_kernel is None else integer_kernel
        release = release_native and integer_kernel  # no graph will need them
        self.int_step = self.int_moe = None
        if config.num_experts and not integer_kernel:
            raise ValueError("a mixture of experts runs in the integer kernel (the fast mode, "
                             "where a compiler built it) or the torch backend, not in ONNX "
                             "Runtime's graphs")
        if config.num_experts:
            self.int_moe = IntMoeStep(config, dense, native, lib, num_threads)
        elif integer_kernel:
            self.int_step = _integer_step(config, dense, native, lib, num_threads, release)
        # ONNX Runtime runs what llmbus's kernels do not: every step of the exact mode, and the
        # fast mode's where no compiler built the kernels or the file has matrices they do not
        # take. Where they do, no graph is built, and no copy of the weights kept for one.
        self.graphs = self.single_thread_graphs = []
        if self.int_step is None and self.int_moe is None:
            self._build_graphs(config, dense, native, num_threads)
        self.embed = self.output_norm = None  # a layer shard's: none (layer_slice.py)
        if config.has_vocab:
            self.embed = TokenEmbedding(native.get("token_embd.weight"),
                                        dense.get("token_embd.weight"))
            self.output_norm = dense["output_norm.weight"].float()  # embeddings' final norm
        self._residual = torch.empty(0, config.hidden_size)
        self.qkv_biases = [qkv_bias(dense, i) for i in range(config.num_layers)]
        self.qk_norms = [qk_norm_weights(dense, i) for i in range(config.num_layers)]
        # The integer kernel's layers and the attention in one C++ call (step_layers.cpp),
        # where no QKV bias or Q/K norm comes between them; tests turn it off to compare the
        # two loops.
        self.fused_layers = (self.int_step is not None and self.paged_attention is not None
                             and all(b is None for b in self.qkv_biases)
                             and all(n is None for n in self.qk_norms))
        self.set_max_positions(max_positions)
        self.scale = config.scale
        self.step_adapters: StepAdapters | None = None  # the runner's, for the next forward
        _return_freed_memory()  # the load's temporaries: unpacked codes, dequantized blocks

    def _build_graphs(self, config: LlamaConfig, dense: dict[str, torch.Tensor],
                      native: dict[str, NativeWeight], num_threads: int) -> None:
        if any(isinstance(w, QuantPart | PackedRows) for w in native.values()):
            raise ValueError("the ONNX Runtime graphs need the matrices as loaded, not tiled "
                             "for the integer kernel (load without tile_as_loaded)")
        from llmbus.services.executor.backends import onnx_graphs as og  # onnx: 0.6 s to load

        def matrix(name: str) -> og.MatrixSource:
            weight = native.get(name)
            if isinstance(weight, KQuantWeight):  # no graph takes 16-weight sub-blocks
                return og.MatrixSource(requantize_q8_0(weight.dequantize().numpy()), None)
            if weight is not None:
                return og.MatrixSource(weight, None)
            return og.MatrixSource(None, dense[name].float().numpy())

        names = [f"blk.{i}.{n}.weight" for i in range(config.num_layers) for n in LAYER_MATRICES]
        matrices = {n: matrix(n) for n in names}
        norms = {n: t.float().numpy() for n, t in dense.items() if n.endswith("norm.weight")}
        graphs = [g.SerializeToString()
                  for g in og.layer_graphs(config, matrices, norms, self.accuracy_level,
                                           qkv_q4_accuracy_level=ACCURACY_EXACT)]
        if config.has_vocab:
            graphs.append(og.head_graph(config, matrix("output.weight"),
                                        norms["output_norm.weight"],
                                        self.accuracy_level).SerializeToString())
        self.graphs = _sessions(graphs, num_threads)
        # Small steps run single-threaded: their matmuls are too short to pay for waking a
        # second pool thread 31 times a step (2 cores, one decode at 300 tokens: 14.5 ms per
        # step alone, 15.9 ms with two threads that sleep between runs).
        self.single_thread_graphs = (_sessions(graphs, 1) if num_threads > 1 else self.graphs)
        del graphs, matrices
        _return_freed_memory()

    def set_max_positions(self, max_positions: int) -> None:
        """Size the rotary tables for positions [0, max_positions): the global layers', and
        the local layers' where they have their own (Gemma 3)."""
        self.rope = [rope_tables(self.config, max_positions, local)  # [P, Dh] each
                     for local in (False, True)[:1 + (self.config.local_rope_theta is not None)]]

    def _projected(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """qkv plus the layer's Q/K/V bias (qwen2), Q and K heads normalised (qwen3); every
        path's projection comes out here, before RoPE."""
        bias, norms = self.qkv_biases[layer], self.qk_norms[layer]
        if bias is not None:
            qkv = qkv + bias
        if norms is not None:
            cfg = self.config
            qkv = qk_rms_norm(qkv, *norms, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps)
        return qkv

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
        """RoPE, the K/V write and attention of one layer: qkv [T, (H + 2 Hkv) Dh] ->
        [T, H * Dh]; the C++ kernel where it was built, else the torch reference. `window`:
        a sliding-window layer's (Gemma 3), 0 for a global one."""
        if self.paged_attention is not None:
            return self.paged_attention(qkv, cos, sin, k_cache, v_cache, meta,
                                        self.config.num_heads, self.scale, window)
        q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                          self.config.num_heads)  # [T, H, Dh]
        return paged_attention(q, k_cache, v_cache, meta, self.scale, window)

    def _attend_layer(self, index: int, qkv: torch.Tensor,
                      rope: list[tuple[torch.Tensor, torch.Tensor]], kv_cache: KVCache,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Layer `index`'s attention: its projection fixed up, its RoPE, its window."""
        cos, sin = rope[self.config.local_rope(index)]
        return self.attend(self._projected(index, qkv), cos, sin, *kv_cache.layer(index), meta,
                           self.config.window(index))

    def _layers(self, layers: list[_Graph], hidden: torch.Tensor,
                rope: list[tuple[torch.Tensor, torch.Tensor]], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Every layer through the ONNX Runtime graphs: hidden [T, D] -> the residual stream
        after the last layer."""
        spare = torch.empty_like(hidden)  # graphs write the new residual beside the old one
        qkv = torch.empty(hidden.shape[0], layers[0].output_widths["qkv"])
        layers[0].run({"hidden": hidden}, {"qkv": qkv})
        for index, graph in enumerate(layers[1:]):
            attn = self._attend_layer(index, qkv, rope, kv_cache, meta)  # [T, H * Dh]
            outputs = {"hidden_out": spare}
            if "qkv" in graph.output_widths:
                outputs["qkv"] = qkv
            graph.run({"hidden": hidden, "attn": attn.contiguous()}, outputs)
            hidden, spare = spare, hidden
        return hidden

    def forward_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata,
                       kv_cache: KVCache) -> torch.Tensor:
        """hidden [T, D], the residual stream into this model's first layer -> after its last
        (Backend.forward_layers). Writes this step's K/V into `kv_cache`."""
        rope = [(cos[positions], sin[positions]) for cos, sin in self.rope]  # [T, Dh] each

        def attend(index: int, qkv: torch.Tensor) -> torch.Tensor:
            return self._attend_layer(index, qkv, rope, kv_cache, meta)

        lora = self.step_adapters.kernel_pointer if self.step_adapters is not None else None
        if lora is not None and self.int_step is None:
            raise ValueError("LoRA adapters run in the integer kernel or the torch backend")
        if self.int_moe is not None:
            return self.int_moe.layers(hidden, attend)
        if self.int_step is not None and self.fused_layers and PagedAttention.takes_whole(meta):
            return self.int_step.layers_with_attention(hidden, *rope[0], kv_cache, meta,
                                                       self.scale, lora)
        if self.int_step is not None:
            return self.int_step.layers(hidden, attend, lora)
        graphs = (self.single_thread_graphs if hidden.shape[0] <= SINGLE_THREAD_TOKENS
                  else self.graphs)
        return self._layers(graphs[:self.config.num_layers + 1], hidden, rope, kv_cache, meta)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the residual stream [T, D] into the first layer (Backend)."""
        assert self.embed is not None, "a layer shard takes hidden states, not tokens"
        hidden = self.embed(input_ids)
        if self.config.embedding_scale != 1.0:
            hidden = hidden * self.config.embedding_scale
        return hidden

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, D] after the last layer; logits_indices [S] -> float32
        logits [S, V] of those rows (Backend)."""
        self._residual = hidden  # for last_hidden: the stream before the output norm
        rows = hidden[logits_indices].contiguous()  # [S, D]
        if not rows.shape[0]:  # a step of prefill chunks alone samples nothing
            return torch.empty(0, self.config.vocab_size)
        if self.int_moe is not None:
            return self.int_moe.head(rows)
        if self.int_step is not None:
            return self.int_step.head(rows)
        graphs = (self.single_thread_graphs if hidden.shape[0] <= SINGLE_THREAD_TOKENS
                  else self.graphs)
        logits = torch.empty(rows.shape[0], self.config.vocab_size)
        graphs[-1].run({"hidden": rows}, {"logits": logits})
        return logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T]; logits_indices [S] -> float32 logits [S, V].

        Writes this step's K/V into `kv_cache` at `meta.slot_mapping`.
        """
        hidden = self.forward_layers(self.embed_tokens(input_ids), positions, meta, kv_cache)
        return self.logits(hidden, logits_indices)

    def last_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        """The last forward's rows after the output norm, in float32 (Backend.last_hidden)."""
        assert self.output_norm is not None, "a layer shard has no output norm"
        return rms_norm(self._residual[rows].float(), self.output_norm, self.config.rms_norm_eps)

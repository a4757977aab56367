"""Load a GGUF of the families model_config.py reads (llama, qwen2, qwen3, gemma3, qwen3moe)
into its config and float weights.

Weights keep their GGUF names (`blk.{i}.attn_q.weight`, ...) in HF layout: `[out, in]`, with a
llama file's Q and K un-permuted from llama.cpp's interleaved rotary layout to the rotate_half
convention (qwen2 and qwen3 files keep HF's), so one RoPE implementation matches HF transformers
on the same file. qwen2's Q/K/V biases load as `blk.{i}.attn_{q,k,v}.bias`, the per-head Q/K
norms of qwen3 and gemma3 as `blk.{i}.attn_{q,k}_norm.weight`, qwen3moe's stacked experts as
3-D tensors (`blk.{i}.ffn_gate_exps.weight`: [experts, out, in]).

`load_gguf(..., keep_native=True)` also returns the quantized matrices in a native form (codes
plus a scale, and for the 4-bit form a minimum, per 32 weights), for the quantized CPU matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmbus.services.executor.weights.gguf_file import MappedGGUF
from llmbus.services.executor.weights.gguf_quants import NativeWeight, native_parsers
from llmbus.services.executor.weights.layer_slice import LayerSlice
from llmbus.services.executor.weights.matrices import expert_matrix
from llmbus.services.executor.weights.model_config import (
    LlamaConfig,
    UnsupportedModelError,
    check_family_tensors,
    read_config,
)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp rotary layout (pairs interleaved per head) -> HF layout (halves per head)."""
    out, inp = w.shape  # w: [out, in]
    return w.reshape(num_heads, out // num_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _add_native(name: str, tensor: Any, shape: tuple[int, ...], parse: Callable[..., NativeWeight],
                heads: int | None, native: dict[str, Any],
                transform: Callable[[str, Any], Any] | None) -> None:
    """The native form of a matrix into `native` (through `transform`); a stacked tensor of
    experts [E, N, K] as one matrix per expert, named expert_matrix's way (views of the
    stacked codes until `transform` tiles them)."""
    if len(shape) == 3:
        num_experts, n, k = shape
        stacked = parse(tensor.data.reshape(num_experts * n, -1), (num_experts * n, k))
        def rows_of(e: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda t: t[e * n:(e + 1) * n]

        pieces = {expert_matrix(name, e): stacked.map_rows(rows_of(e))
                  for e in range(num_experts)}
    else:
        q = parse(tensor.data, shape)
        if heads:  # the permutation moves whole rows: codes, scales and minimums alike
            num_heads = heads
            q = q.map_rows(lambda t: torch.from_numpy(unpermute_qk(t.numpy(), num_heads)))
        pieces = {name: q}
    for name, piece in pieces.items():
        native[name] = piece if transform is None else transform(name, piece)


def interleaved_heads(config: LlamaConfig, name: str) -> int | None:
    """The heads of a Q or K matrix whose rotary pairs the file interleaves, else None."""
    if not config.rotary_pairs_interleaved:
        return None
    return (config.num_heads if name.endswith("attn_q.weight") else
            config.num_kv_heads if name.endswith("attn_k.weight") else None)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, *, keep_native: bool = False,
    dense_for_native: bool = True, transform: Callable[[str, NativeWeight], Any] | None = None,
    exact: bool = False, layers: LayerSlice | None = None,
) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, NativeWeight]]:
    """Read the config and dequantize every tensor to `dtype` (HF layout, see module doc).

    With `keep_native`, the third item holds each quantized matrix's native form as well (same
    names, same un-permuted layout): Q4_1 and Q8_0 as they are, Q4_0 and Q4_K in Q4_1 form
    and Q5_0 in Q8_0 form (exactly), Q5_1, Q5_K and Q6_K requantized to Q8_0 unless `exact`
    (then they load dense, with the file's values); otherwise it is empty.
    Without `dense_for_native`, a matrix with a native form has no dense copy in the second.
    `transform(name, native)` replaces each native form as soon as it is parsed.
    `layers`: a pipeline shard's part alone (layer_slice.py): no other tensor is read.
    """
    import gguf  # heavy import, only where a model is loaded

    parsers = native_parsers(gguf, exact=exact)
    reader = MappedGGUF(path)
    shapes = {t.name: t.shape for t in reader.tensors}
    config = read_config(reader.metadata, shapes)
    check_family_tensors(config, shapes)
    if layers is not None:
        config = layers.config(config)
    weights: dict[str, torch.Tensor] = {}
    native: dict[str, NativeWeight] = {}
    for tensor in reader.tensors:
        name = tensor.name if layers is None else layers.tensor_name(tensor.name)
        if name is None:  # another shard's
            continue
        heads = interleaved_heads(config, name)
        parse = parsers.get(tensor.tensor_type)
        native_form = keep_native and parse is not None and len(shapes[tensor.name]) in (2, 3)
        if dense_for_native or not native_form:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            array = np.asarray(array, dtype=np.float32).reshape(shapes[tensor.name])
            if heads:
                array = unpermute_qk(array, heads)
            if not array.flags.writeable:  # F32 tensors are read-only views of the memory map
                array = array.copy()
            weights[name] = torch.from_numpy(array).to(dtype)
        if native_form:
            assert parse is not None
            _add_native(name, tensor, shapes[tensor.name], parse, heads, native, transform)
        reader.drop_pages(tensor)
    if "rope_freqs.weight" in weights:  # a property of the rotary embedding, not a weight
        factors = tuple(float(f) for f in weights.pop("rope_freqs.weight").float().tolist())
        config = replace(config, rope_freq_factors=factors)
    if config.tie_word_embeddings:
        if "token_embd.weight" in weights:
            weights["output.weight"] = weights["token_embd.weight"]
        if "token_embd.weight" in native:
            native["output.weight"] = native["token_embd.weight"]
    return config, weights, native


def qk_norm_weights(weights: dict[str, torch.Tensor],
                    layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer `layer`'s per-head Q and K norm weights ([Dh] each; qwen3 files), or None."""
    names = (f"blk.{layer}.attn_q_norm.weight", f"blk.{layer}.attn_k_norm.weight")
    if names[0] not in weights:
        return None
    return weights[names[0]], weights[names[1]]


def qkv_bias(weights: dict[str, torch.Tensor], layer: int) -> torch.Tensor | None:
    """Layer `layer`'s Q, K and V biases stacked like its fused projection (qwen2 files have
    them), or None."""
    names = [f"blk.{layer}.attn_{n}.bias" for n in "qkv"]
    present = [n in weights for n in names]
    if not any(present):
        return None
    if not all(present):
        raise UnsupportedModelError(f"layer {layer} has only some of the Q/K/V biases")
    return torch.cat([weights[n].float() for n in names])

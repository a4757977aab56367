"""LoRA adapters' files -> float32 matrices in the executor's layout, and whether one fits a base.

Two formats: a PEFT folder (adapter_config.json + adapter_model.safetensors, what fine-tuning
writes) and llama.cpp's GGUF adapter (what its convert_lora_to_gguf.py writes). Engines on other
hosts get an adapter as bytes from the bus's object store, so `pack_adapter`
(services/adapter_files.py, shared with the api) turns either into one self-contained blob and
`read_adapter` reads only blobs.

Per (layer, target) an adapter holds A [r, in] and B [out, r]; the projection's weight W [out, in]
(HF layout) becomes W + scaling · B·A.
- PEFT stores `...lora_A.weight` [r, in] and `...lora_B.weight` [out, r] as they are; scaling is
  lora_alpha / r, or lora_alpha / √r with use_rslora.
- llama.cpp's converter stores the same two matrices (numpy shapes: `lora_a` [r, in], `lora_b`
  [out, r]; llama-adapter.cpp checks a.ne[0] = in, b.ne[1] = out), scaling alpha / r, or 1 when
  alpha is 0. For a llama file it permutes Q's and K's output rows to the interleaved rotary
  layout as it does the base's, which on a LoRA pair moves B's rows and leaves A: `read_adapter`
  un-permutes B wherever gguf_loader un-permutes the base (`interleaved_heads`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmbus.services import safetensors_blob
from llmbus.services.adapter_files import (
    CONFIG_KEY,
    GGUF_MAGIC,
    PROJECTIONS,
    TARGETS,
    AdapterError,
    adapter_alpha,
    gguf_layout,
    peft_config,
)
from llmbus.services.executor.weights.gguf_file import view_tensors
from llmbus.services.executor.weights.gguf_loader import interleaved_heads, unpermute_qk
from llmbus.services.executor.weights.model_config import LlamaConfig

_GGUF_TARGETS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                 "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_PEFT_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\."
                        r"(?:self_attn\.(q|k|v|o)|mlp\.(gate|up|down))_proj\.lora_(A|B)(?:\.weight)?")
_GGUF_NAME = re.compile(r"blk\.(\d+)\.(" + "|".join(_GGUF_TARGETS) + r")\.weight\.lora_(a|b)")


@dataclass
class LoraWeights:
    rank: int  # the largest rank of its matrices
    scaling: float  # what B·A·x is multiplied by (see the module doc)
    # (layer, target) -> (a [r, in], b [out, r]), float32, contiguous, HF layout
    matrices: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    base_model: str = ""  # adapter_config's base_model_name_or_path (only for messages)


def read_adapter(blob: bytes, arch: str, config: LlamaConfig) -> LoraWeights:
    """`pack_adapter`'s blob, of either format (told apart by the GGUF magic), as LoraWeights.
    `arch` and `config` are the base's: a GGUF adapter's architecture must be `arch`, and its
    Q/K heads (for the un-permute) are `config`'s. AdapterError, one line, for anything it
    cannot take; whether the shapes fit the base is `check_fits`'s to say."""
    weights = _read_gguf(blob, arch, config) if blob.startswith(GGUF_MAGIC) else _read_peft(blob)
    if not weights.matrices:
        raise AdapterError("the adapter holds no LoRA matrices")
    return weights


def check_fits(weights: LoraWeights, config: LlamaConfig, max_rank: int) -> str:
    """"" if the adapter fits the base (the whole model's config, not a layer shard's), else
    one line naming the first mismatch: a layer the base lacks, a matrix's shape, the rank."""
    for layer, target in sorted(weights.matrices, key=lambda k: (k[0], TARGETS.index(k[1]))):
        a, b = weights.matrices[layer, target]
        if layer >= config.num_layers:
            return f"layer {layer} {target}: the base has {config.num_layers} layers"
        if config.num_experts and target in ("gate", "up", "down"):
            return f"layer {layer} {target}: the base's MLP is a mixture of experts"
        out, inp = base_shape(config, target)
        if a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
            return (f"layer {layer} {target}: expected A [r, {inp}] and B [{out}, r], got "
                    f"A {list(a.shape)} and B {list(b.shape)}")
    if weights.rank > max_rank:
        return f"rank {weights.rank} is over --max-lora-rank {max_rank}"
    return ""


def base_shape(config: LlamaConfig, target: str) -> tuple[int, int]:
    """The base's [out, in] for a target's projection."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q),
            "gate": (f, d), "up": (f, d), "down": (d, f)}[target]


def _pair(matrices: dict[tuple[int, str], dict[str, np.ndarray]]
          ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each target's "a" and "b" arrays (both there, ranks agreeing) as float32 tensors."""
    pairs = {}
    for (layer, target), ab in matrices.items():
        if set(ab) != {"a", "b"}:
            raise AdapterError(f"layer {layer} {target}: lora_{next(iter(ab)).upper()} "
                               "without its other half")
        a, b = ab["a"], ab["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"layer {layer} {target}: A {list(a.shape)} and B "
                               f"{list(b.shape)} are not a rank-r pair [r, in], [out, r]")
        pairs[layer, target] = (torch.from_numpy(np.ascontiguousarray(a, np.float32)),
                                torch.from_numpy(np.ascontiguousarray(b, np.float32)))
    return pairs


# --- PEFT: safetensors with adapter_config.json -------------------------------------------------

def _read_peft(blob: bytes) -> LoraWeights:
    try:
        entries, metadata, start = safetensors_blob.read_header(blob)
    except safetensors_blob.SafetensorsError:
        entries, metadata, start = {}, {}, 0
    text = metadata.get(CONFIG_KEY)
    if not isinstance(text, str):
        raise AdapterError("not a LoRA adapter: neither a GGUF file nor a packed PEFT adapter")
    rank, alpha, rslora, base_model = peft_config(text)
    matrices: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, entry in entries.items():
        match = _PEFT_NAME.fullmatch(name)
        if match is None:
            raise AdapterError(f"tensor {name!r} is not a LoRA matrix of {PROJECTIONS}")
        layer, attn, mlp, half = match.groups()
        matrices.setdefault((int(layer), attn or mlp), {})[half.lower()] = \
            _tensor(blob, start, name, entry)
    pairs = _pair(matrices)
    ranks = sorted({a.shape[0] for a, _ in pairs.values()})
    if pairs and ranks != [rank]:
        raise AdapterError(f"the matrices have rank {', '.join(map(str, ranks))}, "
                           f"adapter_config says r = {rank}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return LoraWeights(rank, scaling, pairs, base_model)


def _tensor(blob: bytes, start: int, name: str, entry: Any) -> np.ndarray:
    try:
        return safetensors_blob.read_tensor(blob, start, name, entry)
    except safetensors_blob.SafetensorsError as e:
        raise AdapterError(str(e)) from None


# --- llama.cpp GGUF adapters -------------------------------------------------------------------

def _read_gguf(blob: bytes, arch: str, config: LlamaConfig) -> LoraWeights:
    import gguf  # heavy import, only where an adapter is read

    layout = gguf_layout(blob)
    alpha = adapter_alpha(layout.metadata, arch)
    try:
        tensors = view_tensors(np.frombuffer(blob, np.uint8), layout.tensors, "the adapter")
    except ValueError as e:
        raise AdapterError(str(e)) from None
    matrices: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor in tensors:
        match = _GGUF_NAME.fullmatch(tensor.name)
        if match is None:
            raise AdapterError(f"tensor {tensor.name!r} is not a lora_a/lora_b of "
                               f"{', '.join(_GGUF_TARGETS)}")
        layer, name, half = int(match[1]), match[2], match[3]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise AdapterError(f"tensor {tensor.name!r} is {tensor.tensor_type.name}, which "
                               "gguf-py cannot dequantize") from None
        array = np.array(values, np.float32).reshape(tensor.shape)
        heads = interleaved_heads(config, f"blk.{layer}.{name}.weight")
        if heads and half == "b":
            array = _unpermute_b(array, heads, layer, _GGUF_TARGETS[name])
        matrices.setdefault((layer, _GGUF_TARGETS[name]), {})[half] = array
    pairs = _pair(matrices)
    ranks = sorted({a.shape[0] for a, _ in pairs.values()})
    if len(ranks) > 1:  # llama.cpp scales each by alpha / its own rank; we keep one scaling
        raise AdapterError(f"matrices of different ranks ({', '.join(map(str, ranks))}) are "
                           "not supported")
    rank = ranks[0] if ranks else 0
    return LoraWeights(rank, alpha / rank if alpha and rank else 1.0, pairs)


def _unpermute_b(b: np.ndarray, heads: int, layer: int, target: str) -> np.ndarray:
    """B's rows from the file's interleaved rotary layout back to HF's (see the module doc)."""
    if b.ndim != 2 or b.shape[0] % (2 * heads):
        raise AdapterError(f"layer {layer} {target}: B {list(b.shape)} does not split into "
                           f"{heads} heads of rotary pairs")
    return unpermute_qk(b, heads)

"""Which backends add LoRA deltas, checked once when the executor starts with adapters on.

The integer kernel adds them inside its boundaries (kernels/cpu/lora_delta.cpp), the torch
backend after each projection (StepAdapters.add). ONNX Runtime's graphs fuse each layer's
projections with no place for a per-token delta, and the mixture-of-experts kernel has none:
with adapters on, backend_choice.py picks the torch backend where either would run.
"""

from __future__ import annotations

from llmbus.services.executor.backend import Backend
from llmbus.services.executor.backends.encoder_backend import EncoderBackend
from llmbus.services.executor.lora.adapter_slots import AdapterSlots
from llmbus.services.executor.weights.layer_slice import LayerSlice


def adapter_slots(model: Backend, layers: LayerSlice | None, max_adapters: int,
                  max_rank: int) -> AdapterSlots:
    """The slots of an executor serving adapters; ValueError (one line) where it cannot."""
    if layers is not None:
        raise ValueError("LoRA adapters are not served by a model split by layers (--shard)")
    if isinstance(model, EncoderBackend):
        raise ValueError("an encoder computes embeddings only: it serves no LoRA adapters")
    if model.config.num_experts:
        raise ValueError("LoRA adapters are not served on a mixture of experts")
    if getattr(model, "int_step", True) is None:  # a CPU model on ONNX Runtime's graphs
        raise ValueError("LoRA adapters run in the integer kernel or the torch backend, not "
                         "in ONNX Runtime's graphs (--backend onnxruntime)")
    return AdapterSlots(model.config, max_adapters, max_rank, model.device)

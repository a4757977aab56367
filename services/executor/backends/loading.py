"""The chosen backend, loaded: the GGUF's weights in the form that backend computes with."""

from __future__ import annotations

from pathlib import Path

import torch

from llmbus.services.executor.backend import Backend
from llmbus.services.executor.backend_choice import BackendChoice
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.layer_slice import LayerSlice


def load_backend(model_path: str | Path, choice: BackendChoice, device: torch.device,
                 num_threads: int, layers: LayerSlice | None = None) -> Backend:
    """The backend `choice` names, over the file's weights (`layers`: a pipeline shard's
    alone); its rotary tables are sized later (`set_max_positions`), once the runner knows its
    context window."""
    if choice.backend == "encoder":
        from llmbus.services.executor.backends.encoder_backend import EncoderBackend

        return EncoderBackend.load(model_path)
    if choice.backend == "torch":
        from llmbus.services.executor.backends.torch_llama import LlamaModel

        config, dense, _ = load_gguf(model_path, layers=layers)
        return LlamaModel(config, dense, max_positions=1, dtype=getattr(torch, choice.dtype),
                          device=device)
    from llmbus.services.executor.backends.cpu_llama import CpuLlamaModel
    from llmbus.services.executor.weights.quant_parts import tile_as_loaded

    # The integer kernel takes its matrices tiled: tile each as it is loaded, so the load
    # never holds every matrix twice. ONNX Runtime's graphs read the loaded forms.
    tiled = choice.backend == "integer-kernel"
    config, dense, native = load_gguf(model_path, keep_native=True, dense_for_native=False,
                                      transform=tile_as_loaded if tiled else None,
                                      exact=choice.exact, layers=layers)
    # release_native: what the model does not keep goes as soon as the load returns
    return CpuLlamaModel(config, dense, native, max_positions=1, exact=choice.exact,
                         integer_kernel=tiled, isa=choice.isa, num_threads=num_threads,
                         release_native=True)

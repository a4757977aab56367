"""LoRA adapters' files -> the one blob the bus carries (`pack_adapter`), and the checks of an
adapter's description that packing and reading share. Shared by the api (POST
/v1/load_lora_adapter packs the adapter at a path where the api runs) and the executor
(`--lora NAME=PATH`, and reading blobs: services/executor/weights/lora_files.py), so it imports
neither, nor torch: the api never loads torch to pack an adapter.

Two formats: a PEFT folder (adapter_config.json + adapter_model.safetensors, what fine-tuning
writes) and llama.cpp's GGUF adapter (what its convert_lora_to_gguf.py writes). A packed PEFT
adapter is its safetensors file with adapter_config.json's text in the header's __metadata__; a
GGUF adapter packs as it is.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from llmbus.services import safetensors_blob
from llmbus.services.gguf_metadata import GGUFFormatError, GGUFLayout, read_layout_from

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections an adapter may change
GGUF_MAGIC = b"GGUF"
CONFIG_KEY = "adapter_config"  # a packed PEFT blob's __metadata__ key for adapter_config.json
PROJECTIONS = ", ".join(t + "_proj" for t in TARGETS)  # for messages
# adapter_config.json keys whose setting changes what the adapter computes beyond W + s·B·A
# (VeLoRA, which changes only training's backward pass, is not among them).
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (whole trained modules)",
                "rank_pattern": "rank_pattern (per-module ranks)",
                "alpha_pattern": "alpha_pattern (per-module alphas)",
                "lora_bias": "lora_bias (a bias on lora_B)", "fan_in_fan_out": "fan_in_fan_out",
                "target_parameters": "target_parameters", "layer_replication": "layer_replication",
                "trainable_token_indices": "trainable_token_indices (trained embeddings)",
                "alora_invocation_tokens": "activated LoRA", "use_qalora": "QALoRA",
                "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA",
                "arrow_config": "Arrow routing", "kasa_config": "KaSA"}


class AdapterError(ValueError):
    """An adapter this executor cannot take; the message is one line naming what is wrong."""


def pack_adapter(path: str | Path) -> bytes:
    """A PEFT folder or a llama.cpp GGUF adapter file -> the one blob `read_adapter` takes (the
    bus stores it, so it must be self-contained): a GGUF's bytes as they are; for PEFT the
    safetensors file with adapter_config.json's text added to its header's __metadata__.
    Refuses (AdapterError, one line) what is plainly no adapter we take, before it travels."""
    path = Path(path)
    if path.is_dir():
        config_file, tensors_file = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not config_file.is_file():
            raise AdapterError(f"{path} has no adapter_config.json: not a PEFT adapter folder")
        if not tensors_file.is_file():
            raise AdapterError(f"{path} has no adapter_model.safetensors (a pickled "
                               "adapter_model.bin is not read: save with safe_serialization)")
        text = config_file.read_text()
        peft_config(text)
        try:
            return safetensors_blob.with_metadata(tensors_file.read_bytes(), CONFIG_KEY, text)
        except safetensors_blob.SafetensorsError as e:
            raise AdapterError(f"{tensors_file}: {e}") from None
    if not path.is_file():
        raise AdapterError(f"{path} does not exist")
    blob = path.read_bytes()
    if not blob.startswith(GGUF_MAGIC):
        raise AdapterError(f"{path} is neither a PEFT adapter folder nor a GGUF file")
    adapter_alpha(gguf_layout(blob).metadata, arch=None)
    return blob


def peft_config(text: str) -> tuple[int, float, bool, str]:
    """adapter_config.json's (r, lora_alpha, use_rslora, base_model_name_or_path), after
    refusing what changes the meaning beyond W + s·B·A or targets other projections."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise AdapterError(f"adapter_config.json is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError("adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config['peft_type']!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"adapter_config sets {key}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter_config's bias is {config['bias']!r}: only 'none' is "
                           "supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex on full names: the tensors' names decide
        for module in targets:
            if str(module).rsplit(".", 1)[-1].removesuffix("_proj") not in TARGETS:
                raise AdapterError(f"target module {module!r} is not one of {PROJECTIONS}")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, int | float):
        raise AdapterError(f"adapter_config's r {rank!r} / lora_alpha {alpha!r} are not numbers")
    return rank, float(alpha), bool(config.get("use_rslora")), str(
        config.get("base_model_name_or_path") or "")


def gguf_layout(blob: bytes) -> GGUFLayout:
    try:
        return read_layout_from(io.BytesIO(blob), "the adapter")
    except GGUFFormatError as e:
        raise AdapterError(f"not a readable GGUF: {e}") from None


def adapter_alpha(metadata: dict[str, Any], arch: str | None) -> float:
    """adapter.lora.alpha (0 when absent, as llama.cpp reads it), after checking the file is a
    LoRA adapter (for the architecture `arch`, unless None)."""
    kind = metadata.get("general.type")
    if kind != "adapter":
        raise AdapterError(f"not a LoRA adapter: the GGUF's general.type is {kind!r}, "
                           "not 'adapter'")
    if metadata.get("adapter.type") != "lora":
        raise AdapterError(f"adapter.type is {metadata.get('adapter.type')!r}, not 'lora'")
    if arch is not None and metadata.get("general.architecture") != arch:
        raise AdapterError(f"the adapter is for a {metadata.get('general.architecture')!r} "
                           f"model, the base is {arch!r}")
    return float(metadata.get("adapter.lora.alpha", 0.0))

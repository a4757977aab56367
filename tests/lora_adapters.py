"""LoRA adapters for tests: a PEFT folder with random but trained-looking weights, the same adapter
as a llama.cpp GGUF, and transformers + PEFT as the reference that serving an adapter is held to.

The files are written as their producers write them: PEFT's tensor names and adapter_config.json
keys (test_lora_files checks the names against PEFT's own state dict), and llama.cpp's
convert_lora_to_gguf.py's GGUF (general.type adapter, adapter.type lora, adapter.lora.alpha;
`blk.N.<name>.weight.lora_a` [r, in] and `.lora_b` [out, r], a llama file's Q and K rows
permuted like the base's, which on a LoRA pair moves B's rows).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

from llmbus.services.executor.weights.lora_files import LoraWeights, base_shape
from llmbus.services.executor.weights.model_config import LlamaConfig, read_config
from llmbus.services.gguf_metadata import read_layout
from tests.gguf_fixtures import permute_qk, write_file

PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}
GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
              "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


def base_config(base: LlamaConfig | Path) -> LlamaConfig:
    """A LlamaConfig as it is, or a GGUF model's, read from its header alone."""
    if isinstance(base, LlamaConfig):
        return base
    layout = read_layout(base)
    return read_config(layout.metadata, {t.name: t.info.shape for t in layout.tensors})


def write_peft_adapter(folder: Path, base: LlamaConfig | Path, *, rank: int = 8,
                       alpha: float = 16, targets: tuple[str, ...] = ("q", "v", "gate", "down"),
                       seed: int = 0, layers: list[int] | None = None, use_rslora: bool = False,
                       dtype: torch.dtype = torch.float32, strength: float = 0.5,
                       config_changes: dict | None = None) -> LoraWeights:
    """A PEFT adapter folder for `base` (a config or a GGUF model), as PEFT saves one, with
    random weights; returns what it holds (float32, the values as stored in `dtype`).

    B is not zero (PEFT initialises it so; this is meant to look trained): A ~ N(0, 1/in) and
    B ~ N(0, 1/r) · strength / scaling, so that on inputs of unit entries scaling·B·A·x has about
    `strength` times the spread of a base matrix of N(0, 1/in) entries: enough to change greedy
    output. `layers`: the layers it adapts (default all; numbers beyond the base's are written
    too, for refusal tests). `config_changes` go into adapter_config.json as they are."""
    config = base_config(base)
    layers = list(range(config.num_layers)) if layers is None else layers
    scaling = alpha / (rank ** 0.5 if use_rslora else rank)
    rng = np.random.default_rng(seed)
    tensors, matrices = {}, {}
    for layer in layers:
        for target in targets:
            out, inp = base_shape(config, target)
            a = torch.from_numpy(rng.standard_normal((rank, inp)) / inp ** 0.5).to(dtype)
            b = torch.from_numpy(rng.standard_normal((out, rank)) * strength / scaling
                                 / rank ** 0.5).to(dtype)
            prefix = f"base_model.model.model.layers.{layer}.{PEFT_MODULES[target]}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            matrices[layer, target] = (a.float().contiguous(), b.float().contiguous())
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny-test",
        "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora, "lora_dropout": 0.0,
        "target_modules": sorted(PEFT_MODULES[t].split(".")[1] for t in targets),
        "layers_to_transform": None if layers == list(range(config.num_layers)) else layers,
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False,
        "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
    } | (config_changes or {})
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return LoraWeights(rank, scaling, matrices, "tiny-test")


def write_gguf_adapter(path: Path, weights: LoraWeights, arch: str, alpha: float,
                       config: LlamaConfig, tensor_type: str = "F32") -> Path:
    """`weights` as llama.cpp's convert_lora_to_gguf.py writes them (see the module doc) for a
    base of architecture `arch` with `config`'s heads; `tensor_type` "F32", "F16" or "Q8_0"
    (the converter's --outtype)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    kind = gguf.GGMLQuantizationType[tensor_type]
    for (layer, target), (a, b) in sorted(weights.matrices.items()):
        b_rows = b.numpy()
        heads = {"q": config.num_heads, "k": config.num_kv_heads}.get(target)
        if arch == "llama" and heads:  # the converter's LlamaModel.permute, through B
            b_rows = permute_qk(b_rows, heads)
        name = f"blk.{layer}.{GGUF_NAMES[target]}.weight"
        for suffix, array in (("lora_a", a.numpy()), ("lora_b", b_rows)):
            array = np.ascontiguousarray(array, np.float32)
            if kind == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(f"{name}.{suffix}", array)
            else:
                writer.add_tensor(f"{name}.{suffix}", gguf.quants.quantize(array, kind),
                                  raw_dtype=kind)
    write_file(writer)
    return path


def hf_model(model_path: Path) -> torch.nn.Module:
    """transformers' model of a GGUF (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                dtype=torch.float32).eval()


def with_peft(model: torch.nn.Module, adapter_folder: Path) -> torch.nn.Module:
    """A copy of `model` with the adapter folder loaded by PEFT (float32, eval mode)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_folder)).eval()


def merged(model: torch.nn.Module, weights: LoraWeights) -> torch.nn.Module:
    """A copy of `model` whose every targeted weight is W + scaling·B·A, from `weights`."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for (layer, target), (a, b) in weights.matrices.items():
            module = model.get_submodule(f"model.layers.{layer}.{PEFT_MODULES[target]}")
            module.weight += weights.scaling * (b @ a)
    return model


def logits(model: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    """[T, vocab] logits of one forward over the prompt."""
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0]


def peft_logits(model_path: Path, adapter_folder: Path, prompt_ids: list[int]) -> torch.Tensor:
    """The reference's [T, vocab] logits: transformers + PEFT on the GGUF and the folder."""
    return logits(with_peft(hf_model(model_path), adapter_folder), prompt_ids)


def peft_greedy(model_path: Path, adapter_folder: Path, prompt_ids: list[int],
                max_tokens: int) -> list[int]:
    """The reference's greedy continuation: up to max_tokens, ending at the model's eos as the
    server does (HF `generate`, as tests/hf_reference.py's hf_greedy)."""
    model = with_peft(hf_model(model_path), adapter_folder)
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt_ids):].tolist()


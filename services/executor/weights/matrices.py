"""Which of a GGUF's tensors are layer matrices, and whether llmbus's integer kernel takes a
file, told from its header alone (no torch, nothing loaded): the executor's backend choice
asks before it loads anything."""

from __future__ import annotations

from os import PathLike

from llmbus.services.gguf_metadata import read_metadata, read_tensor_infos

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# A mixture of experts' layer: its experts stacked [E, N, K] in place of the dense MLP.
MOE_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps",
                      "ffn_up_exps", "ffn_down_exps")
COLUMNS = 8  # output columns per column group: one 8-lane vector of the kernels
# The GGML types with a native form (gguf_quants.native_parsers; a test keeps them equal).
NATIVE_GGML_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K",
                     "Q2_K", "IQ4_NL", "IQ4_XS")


# The architectures whose layers the integer kernel computes (Gemma 3's norms after the
# attention and the MLP, and its GeGLU, are not in it).
KERNEL_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
# Mixtures of experts: the integer kernel runs them in the fast mode (backends/int_moe.py), the
# torch backend in the exact one (ONNX Runtime's graphs do not take experts).
MOE_ARCHITECTURES = ("qwen3moe",)


def expert_matrix(name: str, expert: int) -> str:
    """The name one expert's matrix of a stacked tensor takes once split at load:
    `blk.3.ffn_up_exps.weight` -> `blk.3.ffn_up_exps.5.weight`."""
    return f"{name.removesuffix('.weight')}.{expert}.weight"


def architecture(path: str | PathLike[str]) -> str | None:
    """The file's `general.architecture`, from its header."""
    architecture = read_metadata(path).get("general.architecture")
    return architecture if isinstance(architecture, str) else None


def kernel_takes_file(path: str | PathLike[str]) -> bool:
    """An architecture of the kernel's, every layer matrix and the vocabulary head (the
    embedding where tied) in a type with a native form, N a multiple of 8: what
    quant_parts.kernel_takes checks after the load."""
    import gguf

    arch = architecture(path)
    if arch not in KERNEL_ARCHITECTURES:
        return False
    native_types = {int(gguf.GGMLQuantizationType[t]) for t in NATIVE_GGML_TYPES}
    infos = read_tensor_infos(path)
    layers = {name.split(".")[1] for name in infos if name.startswith("blk.")}
    matrices = (MOE_LAYER_MATRICES if arch in MOE_ARCHITECTURES else LAYER_MATRICES)
    names = [f"blk.{i}.{m}.weight" for i in layers for m in matrices]
    names.append("output.weight" if "output.weight" in infos else "token_embd.weight")
    return bool(layers) and all(
        n in infos and infos[n].ggml_type in native_types and len(infos[n].shape) in (2, 3)
        and infos[n].shape[-2] % COLUMNS == 0 for n in names)


def matrix_types(path: str | PathLike[str]) -> str:
    """The file's matrices by type, most first, for the executor's start-up line: "Q4_K 112,
    Q6_K 17, Q8_0 1" (what a user checks a Q3_K_M or IQ4_XS download by)."""
    import gguf

    counts: dict[str, int] = {}
    for info in read_tensor_infos(path).values():
        if len(info.shape) >= 2:
            name = gguf.GGMLQuantizationType(info.ggml_type).name
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} {count}" for name, count in
                     sorted(counts.items(), key=lambda item: (-item[1], item[0])))

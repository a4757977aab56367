"""Which backend computes the model on this machine, decided once at start-up and logged as one
line (`executor backend: ...`).

- `integer-kernel`: llmbus's integer kernel (kernels/cpu/int_step.cpp) + C++ paged attention,
  float16 KV. The fast mode (the default) on a CPU, where a C++ compiler built the kernels and
  they take the file.
- `onnxruntime`: ONNX Runtime's graphs (MatMulNBits) + C++ paged attention (torch attention
  without a compiler). `--exact` on a CPU (float32 activations and KV), and the fast mode's
  fallback (int8 activations, float16 KV).
- `torch`: dense torch weights, Triton kernels on CUDA, torch ops on a CPU. The default on
  CUDA; on a CPU the reference, or `--dtype bfloat16`.

`--backend` forces one (for tests and benchmarks); a forced backend that cannot run here is
refused with the reason, never silently replaced. The choice needs the options, the CPU
(whether the C++ kernels build, for which instruction set) and the file's header (whether the
integer kernel takes every matrix); nothing is loaded to decide.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from os import PathLike

from llmbus.services.executor.weights.encoder_config import ENCODER_ARCHITECTURES
from llmbus.services.executor.weights.matrices import MOE_ARCHITECTURES, architecture

BACKENDS = ("auto", "integer-kernel", "onnxruntime", "torch")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "integer-kernel" | "onnxruntime" | "torch" | "encoder" (BERT's family)
    device: str  # "cpu" | "cuda"
    exact: bool  # greedy output equals HF transformers on the same weights
    dtype: str  # compute dtype of the torch backend; float32 on the CPU backends
    kv_dtype: str
    attention: str  # "C++ paged attention" | "torch attention" | "Triton kernels"
    kernels: str | None  # the CPU kernels' build, in words; None where they did not build
    isa: str | None = None  # their LLMBUS_CPU_ISA level (None: the default)
    note: str | None = None  # why a faster backend does not run, where one might

    def describe(self) -> str:
        """One line a person can read, e.g. "integer kernel (native build, VNNI) + C++ paged
        attention, float16 KV, fast mode"."""
        if self.backend == "encoder":
            return "torch encoder (dense float32 weights, bidirectional attention), embeddings only"
        if self.backend == "integer-kernel":
            what = f"integer kernel ({self.kernels})"
        elif self.backend == "onnxruntime":
            activations = "float32" if self.exact else "int8"
            what = f"ONNX Runtime graphs ({activations} activations)"
        else:
            what = f"torch (dense {self.dtype} weights)"
        where = " on CUDA" if self.device == "cuda" else ""
        mode = "exact mode" if self.exact else "fast mode"
        line = f"{what} + {self.attention}{where}, {self.kv_dtype} KV, {mode}"
        return f"{line} ({self.note})" if self.note else line


def choose_backend(model_path: str | PathLike[str] | None, *, backend: str = "auto",
                   exact: bool = False, dtype: str = "float32", device: str = "auto",
                   cuda_available: bool = False, isa: str | None = None,
                   adapters: bool = False) -> BackendChoice:
    """The backend for these options on this machine; ValueError names what cannot run.

    `adapters`: it serves LoRA adapters, which ONNX Runtime's graphs cannot add
    (lora/backend_support.py): the torch backend runs where they would.

    `model_path` None skips the file check (the integer kernel is then assumed to take it)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    device = device if device != "auto" else ("cuda" if cuda_available else "cpu")
    arch = _architecture(model_path)
    if arch in ENCODER_ARCHITECTURES:  # BERT's family: its own forward, whatever was asked
        if backend != "auto" or device != "cpu" or dtype != "float32":
            raise ValueError(f"an encoder ({arch}) runs on its own CPU backend in float32; "
                             "leave --backend, --device and --dtype at their defaults")
        return BackendChoice("encoder", "cpu", exact=True, dtype="float32",
                             kv_dtype="float32", attention="", kernels=None)
    moe = arch in MOE_ARCHITECTURES
    if backend == "auto":  # (a mixture of experts: the integer kernel's, or torch's)
        backend = "torch" if device != "cpu" or dtype != "float32" or (moe and exact) else "cpu"
    if backend == "torch":
        choice = _torch_choice(device, exact, dtype)
        if moe and device == "cpu" and exact:
            choice = replace(choice, note="a mixture of experts in the exact mode: ONNX "
                                          "Runtime's graphs do not take experts")
        return choice
    if moe and (backend == "onnxruntime" or exact):
        raise ValueError(f"ONNX Runtime's graphs cannot run a mixture of experts ({arch}); "
                         "the integer kernel (the fast mode) or --backend torch can")
    _check_cpu_options(backend, device, dtype)
    choice = _cpu_choice(model_path, backend, exact, isa)
    if adapters and choice.backend == "onnxruntime":
        return _torch_for_adapters(choice, forced=backend == "onnxruntime")
    if moe and choice.backend != "integer-kernel":  # no compiler, or matrices it does not take
        return replace(_torch_choice(device, exact, dtype),
                       note=f"a mixture of experts, and {choice.note or 'no integer kernel'}")
    return choice


def _check_cpu_options(backend: str, device: str, dtype: str) -> None:
    if device != "cpu":
        raise ValueError(f"the {backend} backend runs on the CPU, not {device}; use --backend "
                         "torch there")
    if dtype != "float32":
        raise ValueError(f"--dtype {dtype} is for the torch backend; the CPU backends compute "
                         "in float32 (--exact or not chooses their precision)")


def _torch_for_adapters(choice: BackendChoice, forced: bool) -> BackendChoice:
    """The torch backend where ONNX Runtime's graphs would run a model serving adapters."""
    if forced:
        raise ValueError("ONNX Runtime's graphs cannot add LoRA adapters; leave --backend at "
                         "auto")
    why = "the exact mode" if choice.exact else choice.note
    return replace(_torch_choice("cpu", choice.exact, "float32"),
                   note=f"LoRA adapters, and {why}: ONNX Runtime's graphs take none")


def _architecture(model_path: str | PathLike[str] | None) -> str | None:
    if model_path is None:
        return None
    try:
        return architecture(model_path)
    except (OSError, ValueError):  # the loader names what is wrong with the file
        return None


def _torch_choice(device: str, exact: bool, dtype: str) -> BackendChoice:
    from llmbus.services.cpu_features import cpu_model, has_native_bfloat16

    if exact and dtype != "float32":
        raise ValueError(f"--exact computes in float32, not {dtype}")
    if device == "cpu" and dtype == "bfloat16" and not has_native_bfloat16():
        raise ValueError(f"--dtype bfloat16: this CPU ({cpu_model()}) has no native bfloat16 "
                         "(AVX-512-BF16 or AMX), so torch would emulate it, slower than "
                         "float32; use the default CPU backend instead")
    attention = "Triton kernels" if device == "cuda" else "torch attention"
    return BackendChoice(backend="torch", device=device, exact=dtype == "float32", dtype=dtype,
                         kv_dtype=dtype, attention=attention, kernels=None)


def _cpu_choice(model_path: str | PathLike[str] | None, backend: str, exact: bool,
                isa: str | None) -> BackendChoice:
    """`backend`: "cpu" (the best CPU backend that runs), "integer-kernel" or "onnxruntime"."""
    from llmbus.services.executor.kernels.cpu.library import build_label, builds
    from llmbus.services.executor.weights.matrices import kernel_takes_file

    built = builds(isa)  # not loaded: OpenMP is configured after the choice
    kernels = build_label(isa) if built else None
    attention = "C++ paged attention" if built else "torch attention"
    why_not = ("it has no exact mode" if exact else
               "no C++ compiler built the CPU kernels" if not built else
               "the file has matrices it does not take"
               if model_path is not None and not kernel_takes_file(model_path) else None)
    if backend == "integer-kernel" and why_not:
        raise ValueError(f"--backend integer-kernel cannot run here: {why_not}")
    if backend != "onnxruntime" and not why_not:
        return BackendChoice(backend="integer-kernel", device="cpu", exact=False,
                             dtype="float32", kv_dtype="float16", attention=attention,
                             kernels=kernels, isa=isa)
    note = None if exact or backend == "onnxruntime" else f"no integer kernel: {why_not}"
    return BackendChoice(backend="onnxruntime", device="cpu", exact=exact, dtype="float32",
                         kv_dtype="float32" if exact else "float16", attention=attention,
                         kernels=kernels, isa=isa, note=note)

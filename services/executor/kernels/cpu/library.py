"""Build the CPU kernels (the `*.cpp` files beside this one) into one library, load it.

Compiled with the system's C++ compiler for this very CPU (-march=native) and cached under the
llmbus cache directory, keyed by the sources, the flags, the compiler and the CPU. No torch
headers, so the build takes a few seconds. Where no compiler works, `load_library()` logs
why and returns None, and the executor chooses a backend without them (backend_choice.py).

`LLMBUS_CPU_ISA=avx2` builds for x86-64-v3 (AVX2, FMA, F16C) instead, `avx512` for x86-64-v4,
and `generic` for plain x86-64 (the kernels' loops without intrinsics), so that one machine can
run and test the code every other one gets.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog

from llmbus.services.cpu_features import cpu_flags
from llmbus.services.model_files import cache_root

log = structlog.get_logger()

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# Sources compiled as several objects, each with its defines: the attention's float32- and
# float16-cache entry points build in parallel (one was 12-25 s of a build, by ISA, alone).
SPLIT_SOURCES = {"paged_attention.cpp": (("f32", "-DLLMBUS_PAGED_ATTENTION_F32"),
                                         ("f16", "-DLLMBUS_PAGED_ATTENTION_F16"))}
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ISA_FLAGS = {"native": ("-march=native",), "generic": ("-march=x86-64", "-mtune=generic"),
             "avx2": ("-march=x86-64-v3", "-mtune=generic"),
             "avx512": ("-march=x86-64-v4", "-mtune=generic")}


def default_isa() -> str:
    """The instruction-set level the kernels are built for (LLMBUS_CPU_ISA, default native)."""
    name = os.environ.get("LLMBUS_CPU_ISA", "native") or "native"
    if name not in ISA_FLAGS:
        raise ValueError(f"LLMBUS_CPU_ISA={name!r}: expected one of {', '.join(ISA_FLAGS)}")
    return name


_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Every entry point: (argument types, return type), declared once for ctypes.
SIGNATURES = {
    "paged_attention_f32": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
                             _i64, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_float, _ptr, _ptr,
                             _i32, _i64], _i32),
    # int_step.cpp; its structures are int_step.py's, passed by address
    "int_linear": ([_ptr, _ptr, _i64, _ptr, _i32, _i32], _i32),
    "int_boundary": ([_ptr, _i64, _i64, ctypes.c_float, _ptr, _ptr, _ptr, _i32, _ptr, _i64],
                     _i32),
    "int_head": ([_ptr, _ptr, _i64, _i64, ctypes.c_float, _ptr, _ptr, _i32], _i32),
    # step_layers.cpp
    "int_step_layers": ([_ptr, _i64, _i64, _i64, ctypes.c_float, _ptr, _ptr, _ptr, _i32, _ptr,
                         _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr,
                         _i64, _i64, _i64, ctypes.c_float, _ptr, _ptr, _i32], _i32),
    # lora_delta.cpp; its structures are lora/kernel_tables.py's
    "lora_add": ([_ptr, _i64, _i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i32], _i32),
}
SIGNATURES["paged_attention_f16"] = SIGNATURES["paged_attention_f32"]


# OpenMP threads (the attention kernel's, torch's) share the cores with ONNX Runtime's pools,
# which never spin. Between a step's 30 attention calls they must sleep, or they would take the
# cores from the graphs; within one call they wait at two or three barriers, where sleeping and
# waking costs more than the work (2 Zen 4 cores, 16 decodes behind a 1,024-token prefix:
# 19 ms of attention per step when threads sleep at once, 16 ms when they spin ~3,000 times
# first). libgomp reads this when it starts, so set it before torch or the kernels load.
OPENMP_ENVIRONMENT = {"GOMP_SPINCOUNT": "3000"}


def configure_openmp() -> None:
    """Give OpenMP the executor's waiting policy, unless the environment chose one."""
    if "OMP_WAIT_POLICY" not in os.environ:
        for name, value in OPENMP_ENVIRONMENT.items():
            os.environ.setdefault(name, value)


def build_label(isa: str | None = None) -> str:
    """What the build for `isa` runs on this CPU, in words: the integer kernel's dot products
    use VNNI where the build has it (and AMX tiles for Q4 matrices in steps of 16 tokens or
    more, where the CPU has them), AVX2 otherwise, plain loops without AVX2."""
    isa = isa or default_isa()
    if isa == "generic":
        return "plain-loop build"
    if isa == "avx2":
        return "AVX2 build"
    if isa == "avx512":
        return "AVX-512 build"
    flags = cpu_flags()
    if {"amx_tile", "amx_int8", "avx512_vnni", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        best = "VNNI, AMX where a step has 16 tokens or more"  # amx_tiles.h
    elif {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags:
        best = "VNNI"
    elif {"avx2", "fma", "f16c"} <= flags:
        best = "AVX2"
    else:
        best = "plain loops"
    return f"native build, {best}"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines()
             if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def _library_path(compiler: str, isa: str) -> Path:
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.name.encode() + source.read_bytes())
    for part in (" ".join(ISA_FLAGS[isa]), " ".join(BASE_FLAGS), compiler, _cpu_identity()):
        key.update(part.encode())
    return cache_root() / "kernels" / f"llmbus-cpu-{isa}-{key.hexdigest()[:16]}.so"


def build(compiler: str | None = None, isa: str | None = None) -> Path:
    """Compile the kernels unless the cache has them; the path of the shared library.

    Raises RuntimeError with the compiler's output when the build fails.
    """
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    isa = isa or default_isa()
    path = _library_path(compiler, isa)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: executors starting together never see half a file.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        _compile(compiler, [*BASE_FLAGS, *ISA_FLAGS[isa]], partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    for stale in path.parent.glob(f"llmbus-cpu-{isa}-*.so"):  # older sources or flags
        if stale != path:
            stale.unlink(missing_ok=True)  # a process that mapped it keeps its copy
    return path


def _compile(compiler: str, flags: list[str], out: Path) -> None:
    """Each source to an object file, all at once (the compiler uses one core a file: two
    cores build a library in ~4.5 s instead of ~8), then linked into `out`."""
    with tempfile.TemporaryDirectory(dir=out.parent) as objects:
        jobs = [([*defines, str(source)], Path(objects) / f"{source.stem}{suffix}.o")
                for source in SOURCES
                for suffix, *defines in SPLIT_SOURCES.get(source.name, (("",),))]
        running = [subprocess.Popen([compiler, *flags, "-c", *args, "-o", str(obj)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                   for args, obj in jobs]
        errors = [process.communicate(timeout=300)[1] for process in running]
        failed = [error for process, error in zip(running, errors, strict=True)
                  if process.returncode != 0]
        if failed:
            raise RuntimeError(f"{compiler} failed:\n{failed[0][-4000:]}")
        link = subprocess.run([compiler, *flags, *(str(obj) for _, obj in jobs), "-o", str(out)],
                              capture_output=True, text=True, timeout=300)
        if link.returncode != 0:
            raise RuntimeError(f"{compiler} failed to link:\n{link.stderr[-4000:]}")


@functools.cache
def _built(isa: str | None) -> Path | None:
    """The library's path, or None (logged once) where the kernels do not build."""
    try:
        return build(isa=isa)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels unavailable: no integer kernel, torch attention",
                    error=str(exc)[:500])
        return None


def builds(isa: str | None = None) -> bool:
    """Whether the kernels for `isa` build here, without loading them: loading starts libgomp,
    which reads its environment once (configure_openmp must come first), and the executor
    chooses its backend (backend_choice.py) before it configures OpenMP."""
    return _built(isa) is not None


@functools.cache
def load_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for `isa` (default: LLMBUS_CPU_ISA, else native), or None where they
    cannot be built or loaded."""
    path = _built(isa)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("CPU kernels do not load: no integer kernel, torch attention",
                    error=str(exc)[:500])
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib

"""What this CPU can do, read from /proc/cpuinfo: for choosing kernels and labelling benchmarks.

Machines differ between runs (AVX2-only EPYCs, Zen 4 and Xeons with AVX-512, Xeons with AMX),
so every number llmbus prints names the CPU it was measured on.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import TypedDict

# The flags that decide which kernels run fast, in the order a reader compares them.
NOTABLE_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                 "amx_tile", "amx_bf16", "amx_int8")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    model, flags = platform.machine(), frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == platform.machine():
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def has_native_bfloat16() -> bool:
    """bfloat16 matmuls in hardware (AVX-512-BF16 or AMX); elsewhere torch emulates them,
    slower than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


class CpuSummary(TypedDict):
    model: str
    cores: int | None
    flags: list[str]


def cpu_summary() -> CpuSummary:
    """The CPU's model, core count and notable flags, for benchmark reports."""
    import os

    return {"model": cpu_model(), "cores": os.cpu_count(),
            "flags": [f for f in NOTABLE_FLAGS if f in cpu_flags()]}


def cpu_label() -> str:
    """One line: `AMD EPYC (2 cores): avx2 fma f16c avx512f ...`."""
    summary = cpu_summary()
    return f"{summary['model']} ({summary['cores']} cores): {' '.join(summary['flags'])}"

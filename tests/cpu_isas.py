"""The ISA builds of the CPU kernels this CPU can run, as pytest parameters: an AVX-512
machine also checks the AVX2 build that AVX2-only machines get, and every x86 machine the
plain loops (x86-64 without AVX) that a CPU without AVX2 would run."""

from __future__ import annotations

import pytest

from llmbus.services.cpu_features import cpu_flags

ISA_NEEDS = {"native": set(), "generic": {"sse2"}, "avx2": {"avx2", "fma", "f16c"},
             "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not needs <= cpu_flags(),
                                                   reason=f"this CPU lacks {needs}"))
        for isa, needs in ISA_NEEDS.items()]

"""Rounding float32 results to the output dtype the way torch does, interpreter included."""

from __future__ import annotations

import triton
import triton.language as tl

# Read once at import: the interpreter must be on before any kernel module is imported anyway.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """x -> dtype, rounding to nearest even.

    The interpreter truncates float32 -> bfloat16, so bf16 results would drift an ulp from
    torch's; there the rounding is done by hand on the bits. Compiled kernels use the
    hardware conversion, which already rounds to nearest even.
    """
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)

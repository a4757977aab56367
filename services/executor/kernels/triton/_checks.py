"""Argument checks the launchers run before a launch.

A Triton kernel trusts its pointers and strides: a wrong dtype, a transposed view or a tensor
on another device reads garbage instead of failing, so every launcher checks first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors."""
    return bool(triton.knobs.runtime.interpret)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_tensor(t: torch.Tensor, name: str, shape: Sequence[int | None],
                 dtypes: Sequence[torch.dtype], device: torch.device,
                 unit_last_stride: bool = True) -> None:
    """Rank, sizes (None = any), dtype, device, and a unit stride on the last axis."""
    check(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    check(t.dim() == len(shape), f"{name}: expected {len(shape)} dims, got {tuple(t.shape)}")
    for axis, (got, want) in enumerate(zip(t.shape, shape, strict=True)):
        check(want is None or got == want,
              f"{name}: axis {axis} has size {got}, expected {want} (shape {tuple(t.shape)})")
    check(t.dtype in dtypes, f"{name}: dtype {t.dtype} not in {list(dtypes)}")
    check(t.device == device, f"{name} is on {t.device}, expected {device}")
    if unit_last_stride and t.numel() > 0:
        check(t.stride(-1) == 1, f"{name}: the last axis must be contiguous, strides {t.stride()}")


def check_device(device: torch.device) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU tensors."""
    check(interpreting() or device.type == "cuda",
          f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype,
                device: torch.device) -> None:
    """K/V caches [num_blocks, block_size, Hkv, Dh], contiguous: slots are addressed by stride."""
    check_tensor(k_cache, "k_cache", (None, None, None, None), (dtype,), device)
    check_tensor(v_cache, "v_cache", tuple(k_cache.shape), (dtype,), device)
    check(k_cache.is_contiguous() and v_cache.is_contiguous(),
          "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, Dh]")


def rows_per_program(num_rows: int, on_gpu: int, interpreted: int = 64) -> int:
    """Few rows per program on a GPU; many under the interpreter, which runs programs serially."""
    limit = interpreted if interpreting() else on_gpu
    return max(1, min(limit, triton.next_power_of_2(max(num_rows, 1))))

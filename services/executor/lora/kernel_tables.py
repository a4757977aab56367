"""ctypes mirrors of lora_delta.cpp's structures: a step's adapters as the integer kernel reads
them (every slot's matrices, each token's slot)."""

from __future__ import annotations

import ctypes

# The projections an adapter may change, in the kernel's table order (entry_points.h).
KERNEL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class LoraMatrix(ctypes.Structure):
    """One projection's a [rank, k] and bt [rank, n] (scaled), float32; a null `a`: none."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("k", ctypes.c_int64), ("n", ctypes.c_int64)]


class LoraStep(ctypes.Structure):
    """token_slot [T] int32 (-1: the base alone); matrices [slots, layers, targets]."""

    _fields_ = [("token_slot", ctypes.c_void_p), ("matrices", ctypes.c_void_p),
                ("num_layers", ctypes.c_int64), ("num_slots", ctypes.c_int64)]

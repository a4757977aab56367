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
    """The step's tokens grouped by slot: order [T'] int64 (token indices, the base's left
    out), offsets [slots + 1] int64 (slot s's are order[offsets[s]:offsets[s + 1]]);
    matrices [slots, layers, targets]; num_tokens: the step's T."""

    _fields_ = [("order", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("matrices", ctypes.c_void_p), ("num_layers", ctypes.c_int64),
                ("num_slots", ctypes.c_int64), ("num_tokens", ctypes.c_int64)]

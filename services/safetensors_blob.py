"""safetensors read and rewritten in memory: a LoRA adapter's bytes come from the bus, not a path.

The format: an 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}`, then the tensors' little-endian bytes, each at its
data_offsets [begin, end) from the start of the data. (The `safetensors` package is only a test
dependency: tests write files with it, which holds this reader to the reference writer.)
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

_DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
                                     "BF16": np.dtype("<u2")}


class SafetensorsError(ValueError):
    """Not safetensors this reader takes; the message is one line."""


def read_header(blob: bytes) -> tuple[dict[str, Any], dict[str, str], int]:
    """The tensors' entries (name -> {dtype, shape, data_offsets}), the __metadata__, and where
    the data starts."""
    size = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8:8 + size]) if len(blob) >= 8 + size else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise SafetensorsError("no safetensors header")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError("the safetensors __metadata__ is not a JSON object")
    return header, metadata, 8 + size


def read_tensor(blob: bytes, start: int, name: str, entry: Any) -> np.ndarray:
    """One F32, F16 or BF16 tensor (its header `entry`; the data at `start`) as float32."""
    entry = entry if isinstance(entry, dict) else {}
    dtype = _DTYPES.get(entry.get("dtype", ""))
    if dtype is None:
        raise SafetensorsError(f"tensor {name!r} is {entry.get('dtype')!r}: only F32, F16 and "
                               "BF16 are read")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (_naturals(shape) and _naturals(offsets) and len(offsets) == 2
            and offsets[1] - offsets[0] == math.prod(shape) * dtype.itemsize
            and start + offsets[1] <= len(blob)):
        raise SafetensorsError(f"tensor {name!r}: shape {shape} and data_offsets {offsets} "
                               "do not fit the file")
    raw = np.frombuffer(blob, dtype, math.prod(shape), start + offsets[0])
    if entry["dtype"] == "BF16":  # a bfloat16 is the high half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return raw.astype(np.float32).reshape(shape)


def with_metadata(blob: bytes, key: str, value: str) -> bytes:
    """The blob with `key: value` added to its __metadata__; the data is not touched (its
    offsets count from the data's start, wherever the header ends)."""
    tensors, metadata, start = read_header(blob)
    header = {"__metadata__": {**metadata, key: value}, **tensors}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text + blob[start:]


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, int) and n >= 0 for n in value)

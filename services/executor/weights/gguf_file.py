"""A GGUF file mapped into memory: its metadata and a numpy view of each tensor's data.

gguf-py's GGUFReader builds a numpy view of every metadata field too, which takes seconds for a
49k-token vocabulary the executor never reads (2.5 of the default model's 4 s load on a Xeon
core); the header is read here with services/gguf_metadata.py's parser instead, and only the
tensors are viewed. Each tensor's view has the form GGUFReader gives it (and gguf-py's
`dequantize` takes): the element type for F32, F16 and the integer types, bytes shaped by
`quant_shape_to_byte_shape` for the quantized ones and BF16.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmbus.services.gguf_metadata import TensorEntry, read_layout

# Types whose data is viewed as its elements; every other type is bytes (as gguf-py does).
_ELEMENTS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
             "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class MappedTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (outermost first)
    data: np.ndarray  # a read-only view of the file
    data_offset: int
    n_bytes: int


def view_tensors(buffer: np.ndarray, entries: list[TensorEntry],
                 source: str | Path) -> list[MappedTensor]:
    """A view of each tensor's data in `buffer` (the whole file's bytes, uint8), in the form
    the module doc says; `source` names the file in errors."""
    import gguf  # heavy import, only where a model is loaded

    tensors = []
    for entry in entries:
        kind = gguf.GGMLQuantizationType(entry.info.ggml_type)
        shape = entry.info.shape
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
        raw = buffer[entry.offset:entry.offset + n_bytes]
        if len(raw) != n_bytes:
            raise ValueError(f"{source}: tensor {entry.name} runs past the end of the file")
        element = _ELEMENTS.get(kind.name)
        data = (raw.view(element).reshape(shape) if element is not None else
                raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind)))
        tensors.append(MappedTensor(entry.name, kind, shape, data, entry.offset, n_bytes))
    return tensors


class MappedGGUF:
    """The file's `metadata` (key -> value) and `tensors` (in file order), over one read-only
    memory map that lives as long as this object or any tensor view."""

    def __init__(self, path: str | Path) -> None:
        layout = read_layout(path)
        self.metadata = layout.metadata
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buffer = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensors = view_tensors(buffer, layout.tensors, path)

    def drop_pages(self, tensor: MappedTensor) -> None:
        """Let the kernel drop the file pages of a tensor already copied out: the mapping
        would otherwise keep the whole file resident beside the weights made from it."""
        page = mmap.PAGESIZE
        start = tensor.data_offset // page * page
        end = -(-(tensor.data_offset + tensor.n_bytes) // page) * page
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, min(end, len(self._mmap)) - start)
        except (AttributeError, OSError, ValueError):  # no madvise here: the pages just stay
            pass

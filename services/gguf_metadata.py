"""A GGUF file's key-value metadata, read without its tensors.

gguf-py's GGUFReader parses every field (and every tensor's info) into numpy views, which takes
2.5 s for SmolLM2's 49k-token vocabulary on a Zen 4 core; the stages that only need the
vocabulary and the chat template (tokenizer, detokenizer, the executor's grammars) read the
metadata section directly instead, in a tenth of that. Little-endian files, GGUF v2 and v3.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from os import PathLike
from typing import Any, BinaryIO

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands."""


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFFormatError("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    return f.read(length).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        element, count = _read(f, "<I"), _read(f, "<Q")
        if element == _STRING:
            return [_string(f) for _ in range(count)]
        if element in _NUMPY:
            dtype = np.dtype(_NUMPY[element])
            return np.frombuffer(f.read(dtype.itemsize * count), dtype).tolist()
        return [_value(f, element) for _ in range(count)]
    raise GGUFFormatError(f"unknown metadata value type {kind}")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # numpy order (outermost first): [rows, columns] for a matrix
    ggml_type: int  # gguf.GGMLQuantizationType's value


def _read_header(f: BinaryIO, path: str | PathLike[str]) -> tuple[dict[str, Any], int]:
    if f.read(4) != b"GGUF":
        raise GGUFFormatError(f"{path} is not a GGUF file")
    version = _read(f, "<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} (expected 2 or 3)")
    num_tensors = _read(f, "<Q")
    num_keys = _read(f, "<Q")
    metadata = {}
    for _ in range(num_keys):
        key = _string(f)
        metadata[key] = _value(f, _read(f, "<I"))
    return metadata, num_tensors


def read_metadata(path: str | PathLike[str]) -> dict[str, Any]:
    """Every metadata key of the file with its value (strings, numbers, lists). Read once per
    process and file version: an executor's start asks five times (backend choice, weights,
    tokenizer, grammars, pooling), each 0.2 s of parsing for a 49k-token vocabulary. The dict
    is the caller's; the lists in it are shared, not to be changed."""
    stat = os.stat(path)
    return dict(_read_metadata(os.path.realpath(path), stat.st_size, stat.st_mtime_ns))


@lru_cache(maxsize=8)
def _read_metadata(path: str, _size: int, _mtime_ns: int) -> dict[str, Any]:
    with open(path, "rb") as f:
        return _read_header(f, path)[0]


@dataclass(frozen=True)
class TensorEntry:
    name: str
    info: TensorInfo
    offset: int  # of its data, in the file


@dataclass(frozen=True)
class GGUFLayout:
    """What a file holds and where: its metadata, and each tensor's entry in file order."""

    metadata: dict[str, Any]
    tensors: list[TensorEntry]


def read_layout(path: str | PathLike[str]) -> GGUFLayout:
    """The metadata and every tensor's shape, type and data offset, from the header alone (the
    data is not read)."""
    with open(path, "rb") as f:
        return read_layout_from(f, path)


def read_layout_from(f: BinaryIO, source: str | PathLike[str]) -> GGUFLayout:
    """read_layout's answer from a stream at the file's start (a GGUF held in memory, such as
    a LoRA adapter's bytes from the bus); `source` names it in errors."""
    metadata, num_tensors = _read_header(f, source)
    entries = []
    for _ in range(num_tensors):
        name = _string(f)
        dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
        ggml_type = _read(f, "<I")
        relative = _read(f, "<Q")  # to the data section, which starts aligned
        entries.append((name, TensorInfo(tuple(reversed(dims)), ggml_type), relative))
    alignment = metadata.get("general.alignment", 32)
    if not (isinstance(alignment, int) and alignment > 0 and alignment & (alignment - 1) == 0):
        raise GGUFFormatError(f"{source}: general.alignment {alignment!r} is not a power of two")
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise GGUFFormatError(f"{source}: tensors named twice: {', '.join(twice)}")
    data_start = -(-f.tell() // alignment) * alignment
    return GGUFLayout(metadata, [TensorEntry(name, info, data_start + relative)
                                 for name, info, relative in entries])


def read_tensor_infos(path: str | PathLike[str]) -> dict[str, TensorInfo]:
    """Every tensor's shape and type, from the header alone: what the executor's plan needs to
    know whether a kernel takes the file before loading it."""
    return {entry.name: entry.info for entry in read_layout(path).tensors}


# The tokenizer's keys, each with the gguf-py GGUFWriter method that writes it.
_TOKENIZER_KEYS = (("tokenizer.ggml.model", "add_tokenizer_model"),
                   ("tokenizer.ggml.pre", "add_tokenizer_pre"),
                   ("tokenizer.ggml.tokens", "add_token_list"),
                   ("tokenizer.ggml.scores", "add_token_scores"),
                   ("tokenizer.ggml.token_type", "add_token_types"),
                   ("tokenizer.ggml.merges", "add_token_merges"),
                   ("tokenizer.ggml.bos_token_id", "add_bos_token_id"),
                   ("tokenizer.ggml.eos_token_id", "add_eos_token_id"),
                   ("tokenizer.ggml.unknown_token_id", "add_unk_token_id"),
                   ("tokenizer.ggml.padding_token_id", "add_pad_token_id"),
                   ("tokenizer.ggml.add_bos_token", "add_add_bos_token"),
                   ("tokenizer.ggml.add_eos_token", "add_add_eos_token"),
                   ("tokenizer.ggml.add_space_prefix", "add_add_space_prefix"),
                   ("tokenizer.chat_template", "add_chat_template"))


def copy_tokenizer(writer: Any, source: str | PathLike[str]) -> int:
    """Every tokenizer key of `source` (byte-level or SentencePiece) onto a gguf-py writer, as
    it is there, so that a generated model file (tests, benchmarks) can be served; returns the
    vocabulary's size."""
    metadata = read_metadata(source)
    for key, method in _TOKENIZER_KEYS:
        if key in metadata:
            getattr(writer, method)(metadata[key])
    return len(metadata["tokenizer.ggml.tokens"])

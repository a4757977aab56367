"""The executor's view of a GGUF file (weights/gguf_file.py) is gguf-py's: the same tensors,
offsets, shapes and bytes, the same metadata, on files of every layout the tests write; and a
header gguf-py would refuse is refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llmbus.services.executor.weights.gguf_file import MappedGGUF
from llmbus.services.gguf_metadata import GGUFFormatError
from tests.gguf_fixtures import TinySpec, write_tiny_llama


@pytest.mark.parametrize("quantized", [None, "Q4_1", "Q8_0", "Q5_0"])
def test_every_tensor_and_key_is_gguf_pys(tmp_path, quantized):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, TinySpec(), quantized=quantized)
    ours, theirs = MappedGGUF(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, mine.data_offset, mine.n_bytes) == (
            reference.tensor_type, reference.data_offset, reference.n_bytes)
        assert mine.shape == tuple(reversed(reference.shape.tolist()))
        assert (mine.data.dtype, mine.data.shape) == (reference.data.dtype,
                                                      reference.data.shape)
        assert np.array_equal(mine.data, reference.data)
    assert ours.metadata.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, value in ours.metadata.items():
        assert value == theirs.fields[key].contents(), key


def _two_tensors(path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_tensor("a", np.arange(8, dtype=np.float32))
    writer.add_tensor("b", np.arange(8, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_custom_alignment_places_the_data_where_gguf_py_does(tmp_path):
    _two_tensors(tmp_path / "aligned.gguf", alignment=64)
    [a, b] = MappedGGUF(tmp_path / "aligned.gguf").tensors
    assert a.data_offset % 64 == 0 and b.data_offset % 64 == 0
    assert a.data.tolist() == list(range(8)) and b.data.tolist() == list(range(8))


def test_an_alignment_not_a_power_of_two_is_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    _two_tensors(path)
    data = path.read_bytes()
    key = b"general.alignment"
    if key not in data:  # the writer wrote none: add the key as gguf-py would
        _two_tensors(path, alignment=32)
        data = path.read_bytes()
    at = data.index(key) + len(key) + 4  # after the key and its type (uint32)
    path.write_bytes(data[:at] + (48).to_bytes(4, "little") + data[at + 4:])
    with pytest.raises(GGUFFormatError, match="general.alignment 48"):
        MappedGGUF(path)


def test_a_tensor_named_twice_is_refused(tmp_path):
    path = tmp_path / "twice.gguf"
    _two_tensors(path)
    data = path.read_bytes()
    name_b = (1).to_bytes(8, "little") + b"b"
    assert data.count(name_b) == 1
    path.write_bytes(data.replace(name_b, (1).to_bytes(8, "little") + b"a"))
    with pytest.raises(GGUFFormatError, match="tensors named twice: a"):
        MappedGGUF(path)

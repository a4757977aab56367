"""Which of a model's layers one pipeline shard holds, and what its tensors are called there.

A model split over N executors by contiguous layer ranges: the lead shard (0) holds the token
embedding, the final norm, the output head and its first layers; every other shard only its
layers. A shard loads its layers renamed to 0.. so that every backend runs it as a smaller
model (its config says where its layers sit in the whole: LlamaConfig.layer_offset).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from os import PathLike

from llmbus.services.executor.weights.model_config import LlamaConfig
from llmbus.services.gguf_metadata import read_layout, read_metadata

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")
VOCAB_TENSORS = ("token_embd.weight", "output.weight", "output_norm.weight")


@dataclass(frozen=True)
class LayerSlice:
    """Layers [first, end) of the model; `has_vocab`: the lead shard's vocabulary matrices."""

    first: int
    end: int
    has_vocab: bool

    def tensor_name(self, name: str) -> str | None:
        """`name` as this shard loads it (its layers renumbered from 0), or None: not its."""
        match = _LAYER_TENSOR.match(name)
        if match is None:
            return name if self.has_vocab or name not in VOCAB_TENSORS else None
        layer = int(match.group(1))
        if not self.first <= layer < self.end:
            return None
        return f"blk.{layer - self.first}.{name[match.end():]}"

    def config(self, whole: LlamaConfig) -> LlamaConfig:
        """The shard's config: its layers, and where they sit in the whole."""
        if not 0 <= self.first < self.end <= whole.num_layers:
            raise ValueError(f"layers {self.first}:{self.end} are not a range of the model's "
                             f"{whole.num_layers}")
        return replace(whole, num_layers=self.end - self.first, layer_offset=self.first,
                       has_vocab=self.has_vocab)

    def describe(self) -> str:
        return f"layers {self.first}:{self.end}" + (" and the vocabulary" if self.has_vocab
                                                    else "")


def split_layers(vocab_bytes: int, layer_bytes: Sequence[int], count: int) -> list[range]:
    """The layers in `count` contiguous ranges whose bytes, the lead's counting
    `vocab_bytes` (the head's), are as even as whole layers allow: each shard then reads
    about as many bytes a decode step, and takes about as long a prompt's. At least one
    layer each; where a cut could go either way, the lead takes the fewer."""
    num_layers = len(layer_bytes)
    if not 1 <= count <= num_layers:
        raise ValueError(f"{count} shards: a model of {num_layers} layers takes 1 to "
                         f"{num_layers}")
    before = [vocab_bytes]  # before[j]: the bytes of the vocabulary and of layers [0, j)
    for size in layer_bytes:
        before.append(before[-1] + size)
    cuts = [0]
    for k in range(1, count):
        target = before[-1] * k / count
        cuts.append(min(range(cuts[-1] + 1, num_layers - (count - k) + 1),
                        key=lambda j: abs(before[j] - target)))
    cuts.append(num_layers)
    return [range(first, end) for first, end in zip(cuts, cuts[1:], strict=False)]


def file_split(path: str | PathLike[str], count: int) -> list[range]:
    """split_layers over the bytes of the file's tensors a step reads (every shard computes
    the same). The token embedding counts only where the head reads it too (tied): else a
    step looks up a few of its rows. So the shards compute about as long a step, a
    pipeline's pace being its slowest shard's; the lead holds that much more memory (the
    Llama-3.2-1B-shaped file: layers 0:7 and 7:16, 0.57x and 0.48x of the weights)."""
    sizes = tensor_bytes(path)
    layer_bytes = [0] * model_layers(path)
    vocab_bytes = 0
    for name, size in sizes.items():
        match = _LAYER_TENSOR.match(name)
        if match is not None:
            layer_bytes[int(match.group(1))] += size
        elif name != "token_embd.weight" or "output.weight" not in sizes:
            vocab_bytes += size
    return split_layers(vocab_bytes, layer_bytes, count)


def shard_slice(index: int, count: int, path: str | PathLike[str],
                layers: tuple[int, int] | None = None) -> LayerSlice:
    """Shard `index` of `count` of the model at `path`: its share of the layers
    (file_split), or `layers` (first, end) where the user named them."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: the index counts from 0 to {count - 1}")
    num_layers = model_layers(path)
    if layers is None:
        share = file_split(path, count)[index]
        layers = (share.start, share.stop)
    if not 0 <= layers[0] < layers[1] <= num_layers:
        raise ValueError(f"layers {layers[0]}:{layers[1]} are not a range of the model's "
                         f"{num_layers}")
    if index == 0 and layers[0] != 0:
        raise ValueError(f"the lead shard (0) starts at layer 0, not {layers[0]}")
    return LayerSlice(*layers, has_vocab=index == 0)


def tensor_bytes(path: str | PathLike[str]) -> dict[str, int]:
    """Each tensor's bytes in the file (up to the next tensor's data)."""
    entries = sorted(read_layout(path).tensors, key=lambda entry: entry.offset)
    ends = [entry.offset for entry in entries[1:]] + [os.path.getsize(path)]
    return {entry.name: end - entry.offset for entry, end in zip(entries, ends, strict=True)}


def slice_file_bytes(path: str | PathLike[str], layers: LayerSlice) -> int:
    """The bytes of `layers`' tensors in the file: what the shard's weights weigh as the file
    stores them."""
    return sum(size for name, size in tensor_bytes(path).items()
               if layers.tensor_name(name) is not None)


def model_layers(path: str | PathLike[str]) -> int:
    """The whole model's layer count, from the file's header."""
    metadata = read_metadata(path)
    return int(metadata[f"{metadata['general.architecture']}.block_count"])


def parse_shard(shard: str | None, layers: str | None,
                path: str | PathLike[str]) -> tuple[int, int, LayerSlice | None]:
    """(index, count, its layers) from the executor's `--shard I/N` and `--layers A:B`;
    (0, 1, None) for the whole model. ValueError, in the options' words, when they are wrong."""
    if shard is None:
        if layers is not None:
            raise ValueError("--layers names a shard's layers: give --shard I/N too")
        return 0, 1, None
    index, _, count = shard.partition("/")
    if not (index.isdigit() and count.isdigit()):
        raise ValueError(f"--shard {shard!r}: expected I/N, e.g. 1/2")
    span = None
    if layers is not None:
        first, _, end = layers.partition(":")
        if not (first.isdigit() and end.isdigit()):
            raise ValueError(f"--layers {layers!r}: expected A:B, e.g. 0:15")
        span = (int(first), int(end))
    return int(index), int(count), shard_slice(int(index), int(count), path, span)

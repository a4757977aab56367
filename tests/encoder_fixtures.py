"""Tiny BERT-family encoders for the embedding tests: a `bert` GGUF with a WordPiece vocabulary
written as llama.cpp's converter writes it, the same model as transformers' `BertModel` and
its tokenizer as HF's `BertTokenizer` (from a vocab.txt), and a `nomic-bert` GGUF.

llama.cpp's `BertModel.set_vocab` respells HF's pieces: control tokens stay, "##ing" -> "ing",
any other piece "the" -> "▁the"; [CLS] is written as BOS and [SEP] as EOS (with add_bos/add_eos
true, from the tokenizer's "[CLS] $A [SEP]" template).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.gguf_fixtures import write_tensors

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PUNCTUATION = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
WORDS = ("the quick brown fox jump over lazy dog hello world cafe naive un token embed "
         "model test is a an of to and in it on for with this that what who how why").split()
SUFFIXES = ("s ed ing er est ly able ize ization iz ation ness ful less ment ings "
            "believ ck ump ver azy ord").split()
DIGITS = [str(d) for d in range(10)]
# HF (vocab.txt) spellings, in id order: specials first, then whole pieces, then "##" pieces
VOCAB = [*SPECIALS, *PUNCTUATION, *LETTERS, *DIGITS, *WORDS, "10", "2024",
         *(f"##{c}" for c in LETTERS), *(f"##{s}" for s in SUFFIXES), *(f"##{d}" for d in DIGITS)]
CONTROL, NORMAL = 3, 1  # llama.cpp token types


@dataclass(frozen=True)
class EncoderSpec:
    num_layers: int = 2
    hidden_size: int = 64  # Q8_0 stores rows in blocks of 32
    num_heads: int = 4
    intermediate_size: int = 128
    context_length: int = 64
    layer_norm_eps: float = 1e-12
    pooling_type: int = 1  # llama.cpp's enum: 1 mean, 2 cls
    rope_freq_base: float = 1000.0  # nomic-bert only


def gguf_spellings(vocab: list[str]) -> tuple[list[str], list[int]]:
    """Pieces and token types as convert_hf_to_gguf.py's BertModel.set_vocab writes them."""
    types = [CONTROL if tok in SPECIALS else NORMAL for tok in vocab]
    spelled = [tok if kind == CONTROL else tok[2:] if tok.startswith("##") else "\u2581" + tok
               for tok, kind in zip(vocab, types, strict=True)]
    return spelled, types


def bert_weights(spec: EncoderSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's `bert` tensor names, HF layout ([out, in])."""
    rng = np.random.default_rng(seed)
    d, f = spec.hidden_size, spec.intermediate_size

    def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    weights = {"token_embd.weight": rand(len(VOCAB), d),
               "token_types.weight": rand(2, d),
               "position_embd.weight": rand(spec.context_length, d),
               "token_embd_norm.weight": 1 + rand(d, scale=0.1),
               "token_embd_norm.bias": rand(d, scale=0.1)}
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        for name, out, inp in (("attn_q", d, d), ("attn_k", d, d), ("attn_v", d, d),
                               ("attn_output", d, d), ("ffn_up", f, d), ("ffn_down", d, f)):
            weights[p + name + ".weight"] = rand(out, inp, scale=inp ** -0.5)
            weights[p + name + ".bias"] = rand(out, scale=0.1)
        for norm in ("attn_output_norm", "layer_output_norm"):
            weights[p + norm + ".weight"] = 1 + rand(d, scale=0.1)
            weights[p + norm + ".bias"] = rand(d, scale=0.1)
    return weights


def nomic_weights(spec: EncoderSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's `nomic-bert` names: fused QKV, SwiGLU, no biases,
    no position table (rotary)."""
    rng = np.random.default_rng(seed)
    d, f = spec.hidden_size, spec.intermediate_size
    bert = bert_weights(spec, seed)
    weights = {k: v for k, v in bert.items() if "norm" in k or k in (
        "token_embd.weight", "token_types.weight")}
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        for name, out, inp in (("attn_qkv", 3 * d, d), ("attn_output", d, d),
                               ("ffn_up", f, d), ("ffn_gate", f, d), ("ffn_down", d, f)):
            weights[p + name + ".weight"] = (rng.standard_normal((out, inp))
                                             * inp ** -0.5).astype(np.float32)
    return weights


def stored_as(weights: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    """The values a file holds when its matrices are stored as `kind` (F16, Q8_0, ...), as
    float32: what a reference must compute with to equal a forward on that file."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    return {name: gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
            .astype(np.float32).reshape(a.shape) if a.ndim == 2 else a
            for name, a in weights.items()}


def write_encoder_gguf(path: Path, spec: EncoderSpec, weights: dict[str, np.ndarray],
                       arch: str = "bert", vocab: list[str] = VOCAB, matrix_type: str = "F32",
                       **extra: Any) -> Path:
    """A GGUF with `weights` (its matrices stored as `matrix_type`) and the keys llama.cpp's
    converter writes for `arch`; `extra` overrides or drops keys (`None`) to test refusals."""
    import gguf

    tokens, types = gguf_spellings(vocab)
    writer = gguf.GGUFWriter(str(path), arch)
    keys: dict[str, Any] = {
        f"{arch}.block_count": spec.num_layers, f"{arch}.context_length": spec.context_length,
        f"{arch}.embedding_length": spec.hidden_size,
        f"{arch}.feed_forward_length": spec.intermediate_size,
        f"{arch}.attention.head_count": spec.num_heads,
        f"{arch}.attention.layer_norm_epsilon": spec.layer_norm_eps,
        f"{arch}.attention.causal": False, f"{arch}.pooling_type": spec.pooling_type,
        "tokenizer.ggml.model": "bert", "tokenizer.ggml.pre": "bert-bge",
        "tokenizer.ggml.token_type_count": 2,
        "tokenizer.ggml.bos_token_id": VOCAB.index("[CLS]"),
        "tokenizer.ggml.eos_token_id": VOCAB.index("[SEP]"),
        "tokenizer.ggml.unknown_token_id": VOCAB.index("[UNK]"),
        "tokenizer.ggml.seperator_token_id": VOCAB.index("[SEP]"),
        "tokenizer.ggml.padding_token_id": VOCAB.index("[PAD]"),
        "tokenizer.ggml.mask_token_id": VOCAB.index("[MASK]"),
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True,
    }
    if arch == "nomic-bert":
        keys[f"{arch}.rope.freq_base"] = spec.rope_freq_base
    keys |= extra
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    write_tensors(writer, weights, None if matrix_type == "F32" else matrix_type)
    return path


def hf_bert_tokenizer(folder: Path, do_lower_case: bool = True, vocab: list[str] = VOCAB) -> Any:
    """HF's BertTokenizer from a vocab.txt of `vocab`, as the original model ships it."""
    from transformers import BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("".join(tok + "\n" for tok in vocab))
    return BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=do_lower_case)


_HF_NAMES = {"attn_q": "attention.self.query", "attn_k": "attention.self.key",
             "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
             "attn_output_norm": "attention.output.LayerNorm",
             "ffn_up": "intermediate.dense", "ffn_down": "output.dense",
             "layer_output_norm": "output.LayerNorm"}
_HF_EMBEDDINGS = {"token_embd": "word_embeddings", "token_types": "token_type_embeddings",
                  "position_embd": "position_embeddings", "token_embd_norm": "LayerNorm"}


def hf_bert_model(spec: EncoderSpec, weights: dict[str, np.ndarray]) -> Any:
    """transformers' BertModel (float32, eager attention, no pooler) holding `weights`."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=len(VOCAB), hidden_size=spec.hidden_size,
                        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                        intermediate_size=spec.intermediate_size, hidden_act="gelu",
                        max_position_embeddings=spec.context_length, type_vocab_size=2,
                        layer_norm_eps=spec.layer_norm_eps, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    model = BertModel(config, add_pooling_layer=False).eval()
    state = {}
    for name, array in weights.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("blk."):
            _, layer, short = stem.split(".")
            hf = f"encoder.layer.{layer}.{_HF_NAMES[short]}.{kind}"
        else:
            hf = f"embeddings.{_HF_EMBEDDINGS[stem]}.{kind}"
        state[hf] = torch.from_numpy(array)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("position_ids" in k or "token_type_ids" in k
                                  for k in missing), (missing, unexpected)
    return model

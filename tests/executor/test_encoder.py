# Over 300 lines: the tokenizer, the two forwards, pooling and the refusals share one fixture
# set and one derived tolerance.
"""BERT-family encoders from GGUF: the WordPiece tokenizer against HF's BertTokenizer, the
`bert` forward against transformers' BertModel, `nomic-bert` against a float64 reference
written here from the architecture's definition, the executor's pooling of an encoder's rows,
and the config's refusals.

Tolerance (hidden states). Ours and transformers' are both float32 evaluations of the same
function that differ only in the order of their roundings (SDPA vs eager softmax·V, one flat
batch vs one sequence), so each is as far from the exact function as float32 arithmetic takes
the other. The exact function is computed in float64 (the same transformers model cast to
double: its own rounding, u = 2^-53, is ~1e-9 of float32's). `ERR` = max|transformers32 -
exact| is float32's error on this model and input, measured here rather than guessed; ours must
be within ATOL_FACTOR · max(ERR, u32 · max|exact|) of exact. A worst-case a-priori bound (13
chained reductions of length <= 128 at u32 = 2^-24 each, values up to ~3: 13·128·6e-8·3 = 3e-4)
would hide real mistakes such as GELU's tanh approximation (~1e-4 here); the measured ERR is
~1e-6. A factor of 4 admits another valid rounding order (errors of independent orders add
at most, and their spread is well inside 2x), and the counter-test shows each planted mistake
lands orders of magnitude above it. Pooled, normalised embeddings: cosine distance <= 1e-5
(the issue's bound), where float32 leaves ~1e-7.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbus.bus.messages import ScheduledRequest
from llmbus.services.executor.backends import torch_encoder
from llmbus.services.executor.backends.torch_encoder import EncoderModel
from llmbus.services.executor.embedding_pooling import Pooling
from llmbus.services.executor.weights.encoder_config import read_encoder_config
from llmbus.services.executor.weights.model_config import UnsupportedModelError
from llmbus.services.gguf_metadata import read_layout
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from tests.encoder_fixtures import (
    LETTERS,
    VOCAB,
    EncoderSpec,
    bert_weights,
    hf_bert_model,
    hf_bert_tokenizer,
    nomic_weights,
    stored_as,
    write_encoder_gguf,
)

SPEC = EncoderSpec()
U32 = 2.0 ** -24
ATOL_FACTOR = 4.0
MAX_COSINE_DISTANCE = 1e-5
TEXTS = [
    "Hello, World!", "The quickest brown foxes jumped over the lazy dogs.",
    "Café naïve ÀÉÎ", "unbelievable tokenization", "xyzzy qqq 2024-10 (test)",
    "[CLS] a [MASK] b", "what's THIS?!... e-mail@host", "你好 x\u00a0y\ttab\nnew",
    "z" * 120 + " long", "", "   ", "it is a test of the model; and that's it",
]
# Three sequences of different lengths, as token ids ([CLS] ... [SEP])
TEXT_BATCH = ["Hello, World!", "The quickest brown foxes jumped over the lazy dogs twice.", "a"]


@pytest.fixture(scope="module")
def bert_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    weights = bert_weights(SPEC)
    path = tmp_path_factory.mktemp("bert") / "tiny-bert.gguf"
    return write_encoder_gguf(path, SPEC, weights), weights


@pytest.fixture(scope="module")
def batch(bert_file: tuple[Path, dict]) -> list[list[int]]:
    tokenizer = GGUFTokenizer.from_gguf(bert_file[0])
    return [tokenizer.encode(text, add_special_tokens=True) for text in TEXT_BATCH]


# --- tokenizer -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_wordpiece_ids_equal_hf(bert_file: tuple[Path, dict], tmp_path: Path, text: str):
    ours = GGUFTokenizer.from_gguf(bert_file[0])
    hf = hf_bert_tokenizer(tmp_path)
    assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"]
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]


def test_wordpiece_splits_and_decodes(bert_file: tuple[Path, dict]):
    tokenizer = GGUFTokenizer.from_gguf(bert_file[0])
    ids = tokenizer.encode("Unbelievable, tokenization!", add_special_tokens=True)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "[CLS]", "un", "##believ", "##able", ",", "token", "##ization", "!", "[SEP]"]
    assert tokenizer.decode(ids) == "unbelievable, tokenization!"
    assert tokenizer.encode("qqq xyzzy")[:1] == [VOCAB.index("q")]  # letters, not [UNK]
    assert tokenizer.encode("z" * 101) == [VOCAB.index("[UNK]")]  # HF's 100-character limit


def test_old_files_name_cls_and_sep(tmp_path: Path):
    """Files from before gguf-py wrote [CLS]/[SEP] as BOS/EOS carry cls/seperator ids."""
    path = write_encoder_gguf(tmp_path / "old.gguf", SPEC, {}, **{
        "tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.eos_token_id": None,
        "tokenizer.ggml.add_bos_token": None, "tokenizer.ggml.add_eos_token": None,
        "tokenizer.ggml.cls_token_id": VOCAB.index("[CLS]")})
    ids = GGUFTokenizer.from_gguf(path).encode("hello", add_special_tokens=True)
    assert ids == [VOCAB.index(t) for t in ("[CLS]", "hello", "[SEP]")]


def test_cased_vocabulary_keeps_case(tmp_path: Path):
    vocab = [*VOCAB, "Hello", "The", *(c.upper() for c in LETTERS), "##É", "É"]
    path = write_encoder_gguf(tmp_path / "cased.gguf", SPEC, {}, vocab=vocab)
    ours, hf = GGUFTokenizer.from_gguf(path), hf_bert_tokenizer(tmp_path, False, vocab)
    for text in ("Hello the THE hello", "École Été café"):
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"]


# --- bert forward ----------------------------------------------------------------------------

def _alone_in_hf(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _references(weights: dict, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' hidden states of each sequence alone, in float32 and float64, [T, D]."""
    hf = hf_bert_model(SPEC, weights)
    hf32 = torch.cat([_alone_in_hf(hf, s) for s in seqs])
    hf64 = torch.cat([_alone_in_hf(hf.double(), s) for s in seqs])
    return hf32, hf64


def _tolerance(float32: torch.Tensor, exact: torch.Tensor) -> float:
    err = (float32.double() - exact).abs().max().item()
    return ATOL_FACTOR * max(err, U32 * exact.abs().max().item())


def _forward(model: EncoderModel, seqs: list[list[int]]) -> torch.Tensor:
    return model.forward(torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])


def test_bert_equals_transformers(bert_file: tuple[Path, dict], batch: list[list[int]]):
    path, weights = bert_file
    hf32, hf64 = _references(weights, batch)
    ours = _forward(EncoderModel.load(path), batch)
    assert (ours.double() - hf64).abs().max().item() <= _tolerance(hf32, hf64)


@pytest.mark.parametrize("matrix_type", ["F16", "Q8_0"])
def test_quantized_files_load_dense(tmp_path: Path, batch: list[list[int]], matrix_type: str):
    """Downloaded files store their matrices as F16 or Q8_0: they load as those values."""
    weights = bert_weights(SPEC)
    path = write_encoder_gguf(tmp_path / "q.gguf", SPEC, weights, matrix_type=matrix_type)
    hf32, hf64 = _references(stored_as(weights, matrix_type), batch)
    ours = _forward(EncoderModel.load(path), batch)
    assert (ours.double() - hf64).abs().max().item() <= _tolerance(hf32, hf64)


def _pooled(hidden: torch.Tensor, seq_lens: list[int], kind: str) -> torch.Tensor:
    """Each sequence's rows pooled as the executor pools them (embedding_pooling.Pooling, the
    whole prompt in one chunk, as an encoder takes it), normalised as the api does."""
    vectors, first = [], 0
    for i, n in enumerate(seq_lens):
        pooled = Pooling(kind, n).fold(ScheduledRequest(f"s{i}", 0, n), first, hidden)
        assert pooled is not None
        vectors.append(torch.frombuffer(bytearray(pooled.vector), dtype=torch.float32))
        first += n
    return F.normalize(torch.stack(vectors), dim=-1)


@pytest.mark.parametrize("kind", ["mean", "cls"])
def test_bert_pooled_embeddings_equal_transformers(bert_file: tuple[Path, dict],
                                                   batch: list[list[int]], kind: str):
    path, weights = bert_file
    seq_lens = [len(s) for s in batch]
    hf32, _ = _references(weights, batch)
    ours = _pooled(_forward(EncoderModel.load(path), batch), seq_lens, kind)
    rows = hf32.split(seq_lens)
    theirs = torch.stack([r.mean(0) if kind == "mean" else r[0] for r in rows])
    cosine = (ours.double() * F.normalize(theirs.double(), dim=-1)).sum(-1)
    assert (1 - cosine).abs().max().item() <= MAX_COSINE_DISTANCE


def test_a_batch_gives_each_sequence_its_rows_alone(bert_file: tuple[Path, dict],
                                                    batch: list[list[int]]):
    """Not bit for bit: a matmul over more rows may block its sums otherwise. Both are float32
    evaluations, each within float32's error of the exact function (see the module's doc)."""
    model = EncoderModel.load(bert_file[0])
    tolerance = _tolerance(*_references(bert_file[1], batch))
    together = _forward(model, batch).split([len(s) for s in batch])
    for seq, rows in zip(batch, together, strict=True):
        assert (rows - _forward(model, [seq])).abs().max().item() <= tolerance


@pytest.mark.parametrize("mistake", ["causal mask", "no token type row", "tanh GELU",
                                     "one sequence for the whole batch"])
def test_each_mistake_fails_the_comparison(bert_file: tuple[Path, dict], batch: list[list[int]],
                                           monkeypatch: pytest.MonkeyPatch, mistake: str):
    """So the tolerance above can fail: each plausible mistake lands far outside it."""
    path, weights = bert_file
    hf32, hf64 = _references(weights, batch)
    model = EncoderModel.load(path)
    if mistake == "causal mask":
        monkeypatch.setattr(torch_encoder.F, "scaled_dot_product_attention", functools.partial(
            F.scaled_dot_product_attention, is_causal=True))
    elif mistake == "no token type row":
        model.config = dataclasses.replace(model.config, has_token_types=False)
    elif mistake == "tanh GELU":
        monkeypatch.setattr(torch_encoder.F, "gelu", functools.partial(F.gelu,
                                                                       approximate="tanh"))
    else:  # positions counted on, and attention across, from one sequence to the next
        ids = torch.tensor([t for s in batch for t in s])
        monkeypatch.setattr(model, "forward", lambda *_: EncoderModel.forward(
            model, ids, [len(ids)]))
    ours = _forward(model, batch)
    assert (ours.double() - hf64).abs().max().item() > 10 * _tolerance(hf32, hf64)


# --- nomic-bert ------------------------------------------------------------------------------

def _nomic_reference(weights: dict[str, np.ndarray], ids: list[int], dtype: torch.dtype,
                     theta: float) -> torch.Tensor:
    """nomic-bert from its definition (nomic-ai's NomicBertModel, non-interleaved rotary, as
    llama.cpp's NEOX rope), one sequence, plain loops and an explicit softmax: [L, D]."""
    w = {k: torch.from_numpy(v).to(dtype) for k, v in weights.items()}
    d, heads = SPEC.hidden_size, SPEC.num_heads
    dh, length = d // heads, len(ids)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + SPEC.layer_norm_eps) * w[name + ".weight"] \
            + w[name + ".bias"]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [L, H, Dh]: pair i with i + Dh/2
        pairs = torch.complex(x[..., :dh // 2].double(), x[..., dh // 2:].double())
        angle = torch.outer(torch.arange(length, dtype=torch.float64),
                            theta ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh))
        turned = pairs * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([turned.real, turned.imag], -1).to(dtype)

    x = norm(w["token_embd.weight"][ids] + w["token_types.weight"][0], "token_embd_norm")
    for i in range(SPEC.num_layers):
        p = f"blk.{i}."
        q, k, v = (x @ w[p + "attn_qkv.weight"].T).reshape(length, 3, heads, dh).unbind(1)
        q, k = rotate(q), rotate(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / dh ** 0.5
        probs = scores.exp() / scores.exp().sum(-1, keepdim=True)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(length, d)
        x = norm(x + attn @ w[p + "attn_output.weight"].T, p + "attn_output_norm")
        gate, up = x @ w[p + "ffn_gate.weight"].T, x @ w[p + "ffn_up.weight"].T
        mlp = (gate / (1 + torch.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        x = norm(x + mlp, p + "layer_output_norm")
    return x


def test_nomic_bert_equals_its_definition(tmp_path: Path, batch: list[list[int]]):
    weights = nomic_weights(SPEC)
    path = write_encoder_gguf(tmp_path / "nomic.gguf", SPEC, weights, arch="nomic-bert")
    model = EncoderModel.load(path)
    assert model.config.rope_theta == SPEC.rope_freq_base and model.config.rotary
    theta = SPEC.rope_freq_base
    ref32 = torch.cat([_nomic_reference(weights, s, torch.float32, theta) for s in batch])
    ref64 = torch.cat([_nomic_reference(weights, s, torch.float64, theta) for s in batch])
    ours = _forward(model, batch).double()
    assert (ours - ref64).abs().max().item() <= _tolerance(ref32, ref64)
    wrong_base = torch.cat([_nomic_reference(weights, s, torch.float64, 10_000.0)
                            for s in batch])  # so the rotary check can fail
    assert (wrong_base - ref64).abs().max().item() > 10 * _tolerance(ref32, ref64)


# --- config ----------------------------------------------------------------------------------

def test_config_reads_llama_cpp_keys(bert_file: tuple[Path, dict]):
    layout = read_layout(bert_file[0])
    config = read_encoder_config(layout.metadata, {t.name: t.info.shape
                                                   for t in layout.tensors})
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads,
            config.intermediate_size, config.context_length, config.vocab_size) == (
        "bert", SPEC.num_layers, SPEC.hidden_size, SPEC.num_heads, SPEC.intermediate_size,
        SPEC.context_length, len(VOCAB))
    assert config.pooling_type == 1 and config.has_token_types and not config.rotary
    assert config.layer_norm_eps == pytest.approx(SPEC.layer_norm_eps)


@pytest.mark.parametrize(("change", "message"), [
    ({"bert.attention.head_count": None}, "the GGUF has no bert.attention.head_count"),
    ({"bert.pooling_type": 7}, "bert.pooling_type 7 is not one of llama.cpp's"),
    ({"bert.attention.causal": True}, "not a bidirectional encoder"),
    ({"drop": "blk.1.ffn_down.weight"}, "the GGUF has no tensor blk.1.ffn_down.weight"),
    ({"general.architecture": "llama"}, "architecture 'llama' is not an encoder"),
])
def test_config_refuses_with_one_line(tmp_path: Path, change: dict, message: str):
    weights = bert_weights(SPEC)
    weights.pop(change.pop("drop", ""), None)
    if "general.architecture" in change:
        metadata = {"general.architecture": "llama"}
        shapes = {name: a.shape for name, a in weights.items()}
    else:
        layout = read_layout(write_encoder_gguf(tmp_path / "x.gguf", SPEC, weights, **change))
        metadata, shapes = layout.metadata, {t.name: t.info.shape for t in layout.tensors}
    with pytest.raises(UnsupportedModelError, match=message) as refusal:
        read_encoder_config(metadata, shapes)
    assert "\n" not in str(refusal.value)

"""BERT's WordPiece tokenizer rebuilt from a GGUF vocabulary (`tokenizer.ggml.model` bert:
bge, all-MiniLM, mxbai-embed, nomic-embed-text).

llama.cpp's converter (convert_hf_to_gguf.py, `BertModel.set_vocab`) respells HF's vocabulary
before writing it: a control token ([CLS], [SEP], ...) is kept as it is, a continuation piece
loses its "##" ("##ing" -> "ing"), and every other piece gains a phantom space ("the" ->
"▁the"). Its WPM tokenizer (src/llama-vocab.cpp) then prepends "▁" to each word and matches
longest-first. We undo the respelling and hand HF's own spelling to `tokenizers`' WordPiece, so
that the normalisation, punctuation split and longest-match-first rule are exactly those of
HF's `BertTokenizerFast` on the original vocab.txt (llama.cpp's hand-written copy lowercases
cased vocabularies and keeps accents, and so differs from HF on those).

Shared by the stages that read a model's vocabulary, like gguf_tokenizer.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL, kept as is by the converter
PHANTOM_SPACE = "\u2581"  # marks a word-initial piece in a GGUF BERT vocabulary
CONTINUATION = "##"  # HF's prefix of a piece that continues a word
# HF BertTokenizer's limit: a longer word is one [UNK] (llama.cpp has none)
MAX_INPUT_CHARS_PER_WORD = 100
# A cased vocabulary (bert-base-cased) has thousands of pieces with a capital letter; an
# uncased one none, or a stray few. The GGUF does not record `do_lower_case`.
CASED_FRACTION = 0.01


def hf_spellings(tokens: Sequence[str], token_types: Sequence[int]) -> list[str]:
    """The vocab.txt spelling of each GGUF token: the converter's respelling undone."""
    out = []
    for tok, kind in zip(tokens, token_types, strict=True):
        if kind == CONTROL_TOKEN_TYPE:
            out.append(tok)
        elif tok.startswith(PHANTOM_SPACE):
            out.append(tok[len(PHANTOM_SPACE):])
        else:
            out.append(CONTINUATION + tok)
    return out


def is_uncased(spellings: Sequence[str], token_types: Sequence[int]) -> bool:
    """Whether the vocabulary was lowercased (then the text must be too, and its accents
    stripped, as HF's BertTokenizer does with `do_lower_case=True`)."""
    normal = [tok for tok, kind in zip(spellings, token_types, strict=True)
              if kind != CONTROL_TOKEN_TYPE]
    num_cased = sum(any(c.isupper() for c in tok) for tok in normal)
    return num_cased <= CASED_FRACTION * max(len(normal), 1)


def wordpiece_tokenizer(spellings: Sequence[str], token_types: Sequence[int],
                        unk_token_id: int | None) -> tuple[Tokenizer, Callable[[str], bool]]:
    """HF's BERT tokenizer over `spellings` (vocab.txt form), without special tokens (the
    caller adds the control tokens and [CLS]/[SEP]); and which tokens are spelled in the
    vocabulary's alphabet (all: WordPiece has none of its own)."""
    vocab = {tok: index for index, tok in enumerate(spellings)}
    unk = spellings[unk_token_id] if unk_token_id is not None else "[UNK]"
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk,
                                           continuing_subword_prefix=CONTINUATION,
                                           max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD))
    lowercase = is_uncased(spellings, token_types)
    # strip_accents=None: accents go with lowercasing, as in HF's BertTokenizer
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix=CONTINUATION, cleanup=True)
    return tokenizer, lambda tok: True


def cls_sep_ids(get: Callable[[str], Any], tokens: Sequence[str]) -> tuple[int | None,
                                                                             int | None]:
    """[CLS] and [SEP] ids: older converters wrote `tokenizer.ggml.cls_token_id` and
    `seperator_token_id` (llama.cpp's spelling); newer ones write [CLS] as BOS and [SEP] as EOS
    (gguf-py's SpecialVocab falls back to cls/sep for a tokenizer without bos/eos)."""
    def first(*keys: str, name: str) -> int | None:
        for key in keys:
            if (value := get(key)) is not None:
                return int(value)
        return tokens.index(name) if name in tokens else None

    return (first("tokenizer.ggml.cls_token_id", "tokenizer.ggml.bos_token_id", name="[CLS]"),
            first("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id",
                  name="[SEP]"))

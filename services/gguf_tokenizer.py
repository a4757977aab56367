"""A tokenizer rebuilt from a GGUF file's metadata alone: byte-level BPE (`tokenizer.ggml.model`
gpt2: SmolLM2, Llama 3, Qwen2), SentencePiece-style BPE (llama: Llama 2, Mistral) or BERT's
WordPiece (bert: embedding encoders; gguf_wordpiece.py).

A GGUF carries no `tokenizer.json`, only llama.cpp's metadata keys (vocabulary, merges or
scores, token types, special token ids, chat template). We rebuild the `tokenizers.Tokenizer`
the model was trained with from those, so that serving needs neither transformers nor a model
hub. A SentencePiece vocabulary has scores instead of merges: two pieces merge when their
concatenation is in the vocabulary, the highest-scoring concatenation first; spaces are spelled
"▁" with one prepended to the text, and a character outside the vocabulary falls back to its
UTF-8 bytes (`<0x..>` tokens).

Shared by the stages that read a model's vocabulary (tokenizer, detokenizer), like
model_files.py; no service imports another service's modules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import cache
from os import PathLike

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from llmbus.services.gguf_wordpiece import cls_sep_ids, hf_spellings, wordpiece_tokenizer

CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens such as <|im_end|>
USER_DEFINED_TOKEN_TYPE = 4  # added tokens matched whole in text, but not special
# llama.cpp's names: byte-level BPE, SentencePiece-style BPE with byte fallback, WordPiece
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama", "bert")
SPACE = "\u2581"  # how a SentencePiece vocabulary spells a space
# How text is cut into words before byte-level BPE, by llama.cpp's name for it in a GGUF
# (`tokenizer.ggml.pre`). Each family splits differently (digits one by one or in threes,
# contractions, newlines), and the wrong split gives wrong ids silently, so a name not here is
# refused. Llama 3's and Qwen2's patterns are those of their published tokenizer.json files.
_LLAMA3_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {
    # SmolLM2: digits one by one, then GPT-2's words
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_WORDS),  # Llama 3.x
    "qwen2": lambda: _split_then_bytes(_QWEN2_WORDS),  # Qwen2, Qwen2.5
}
NFC_PRE_TOKENIZERS = ("qwen2",)  # text is NFC-normalized first
SUPPORTED_PRE_TOKENIZERS = tuple(PRE_TOKENIZERS)


class UnsupportedTokenizerError(ValueError):
    """The GGUF describes a tokenizer this module cannot rebuild."""


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _byte_level(tokens: Sequence[str], merges: Sequence[str],
                pre: str) -> tuple[Tokenizer, Callable[[str], bool]]:
    """Byte-level BPE; and whether a token is spelled in the byte alphabet."""
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizerError(
            f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Files should spell every token in the byte alphabet; respell the odd one that is not.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): index
        for index, tok in enumerate(tokens)
    }
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    if pre in NFC_PRE_TOKENIZERS:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, lambda tok: set(tok) <= alphabet


def sentencepiece_merges(vocab: dict[str, int],
                         scores: Sequence[float]) -> list[tuple[str, str]]:
    """The merges a scored vocabulary implies: every way to cut a piece in two known pieces,
    the best-scoring piece's cuts first (its longer left parts first, then by the parts'
    ids), as llama.cpp's SentencePiece tokenizer merges."""
    cuts = []
    for piece, index in vocab.items():
        for at in range(1, len(piece)):
            left, right = piece[:at], piece[at:]
            if left in vocab and right in vocab:
                cuts.append((-scores[index], -len(left), -len(right), vocab[left], vocab[right],
                             left, right))
    cuts.sort()
    return [(left, right) for *_, left, right in cuts]


def _sentencepiece(tokens: Sequence[str], scores: Sequence[float] | None,
                   add_space_prefix: bool,
                   unk_token_id: int | None) -> tuple[Tokenizer, Callable[[str], bool]]:
    """SentencePiece-style BPE with byte fallback, as Llama 2 and Mistral files describe it."""
    if scores is None:
        raise UnsupportedTokenizerError("a SentencePiece vocabulary (tokenizer.ggml.model "
                                        "llama) needs tokenizer.ggml.scores")
    vocab = {tok: index for index, tok in enumerate(tokens)}
    unk = tokens[unk_token_id] if unk_token_id is not None else "<unk>"
    bpe = models.BPE(vocab=vocab, merges=sentencepiece_merges(vocab, scores), fuse_unk=True,
                     byte_fallback=True, unk_token=unk if unk in vocab else None)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, lambda tok: True


class GGUFTokenizer:
    """Encode/decode with the vocabulary of a GGUF model.

    Byte-level files split words as their `tokenizer.ggml.pre` names (PRE_TOKENIZERS). For
    SmolLM2 (`smollm`) this matches transformers' `AutoTokenizer.from_pretrained(dir,
    gguf_file=...)` ids on ordinary text; digits are split one by one before byte-level BPE, as
    in the SmolLM2 `tokenizer.json`, a step transformers' GGUF loader omits, which only changes
    ids for non-ASCII numerals after a space or next to each other (e.g. " ½").
    """

    def __init__(self, *, tokens: Sequence[str], token_types: Sequence[int],
                 merges: Sequence[str], bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, pre: str = "smollm", model: str = "gpt2",
                 scores: Sequence[float] | None = None, add_space_prefix: bool = True,
                 unk_token_id: int | None = None) -> None:
        if model == "llama":
            tokenizer, spelled = _sentencepiece(tokens, scores, add_space_prefix, unk_token_id)
        elif model == "bert":  # spelled as vocab.txt from here on ("##ing", not "ing")
            tokens = hf_spellings(tokens, token_types)
            tokenizer, spelled = wordpiece_tokenizer(tokens, token_types, unk_token_id)
        else:
            tokenizer, spelled = _byte_level(tokens, merges, pre)
        # A control token spelled outside the vocabulary's alphabet is a llama.cpp mislabel
        # (transformers skips those too): adding it would grow the vocabulary past the model's
        # embedding size.
        special = [AddedToken(tok, normalized=False, special=True)
                   for tok, kind in zip(tokens, token_types, strict=True)
                   if kind == CONTROL_TOKEN_TYPE and spelled(tok)]
        tokenizer.add_special_tokens(special)
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        user_defined = [AddedToken(tok, normalized=False, special=False)
                        for tok, kind in zip(tokens, token_types, strict=True)
                        if kind == USER_DEFINED_TOKEN_TYPE and tok in vocab]
        tokenizer.add_tokens(user_defined)

        self._tokenizer = tokenizer
        self.model = model
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.special_token_ids = frozenset(tokenizer.token_to_id(t.content) for t in special)

    @classmethod
    def from_gguf(cls, path: str | PathLike[str]) -> GGUFTokenizer:
        """Read the tokenizer metadata of a GGUF file (the tensors are not loaded)."""
        from llmbus.services.gguf_metadata import read_metadata

        get = read_metadata(path).get

        model = get("tokenizer.ggml.model")
        if model not in SUPPORTED_TOKENIZER_MODELS:
            raise UnsupportedTokenizerError(
                f"{path}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}")
        pre = get("tokenizer.ggml.pre")
        if (model == "gpt2" and pre is not None  # absent: files predating the key, which
                and pre not in SUPPORTED_PRE_TOKENIZERS):  # llama.cpp also serves as is
            raise UnsupportedTokenizerError(
                f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
        tokens = get("tokenizer.ggml.tokens")
        if tokens is None:
            raise UnsupportedTokenizerError(f"{path}: no vocabulary (tokenizer.ggml.tokens)")
        spm = model == "llama"
        # BERT: `add_special_tokens` gives [CLS] ... [SEP], as HF's template and llama.cpp do
        bos, eos = (cls_sep_ids(get, tokens) if model == "bert" else
                    (get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")))
        return cls(
            tokens=tokens,
            token_types=get("tokenizer.ggml.token_type") or [1] * len(tokens),
            merges=get("tokenizer.ggml.merges", []),
            bos_token_id=bos, eos_token_id=eos,
            chat_template=get("tokenizer.chat_template"),
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos_token=model == "bert" or bool(get("tokenizer.ggml.add_bos_token", spm)),
            add_eos_token=model == "bert" or bool(get("tokenizer.ggml.add_eos_token", False)),
            pre=pre or "smollm",  # absent: files predating the key, split as SmolLM2 does
            model=model, scores=get("tokenizer.ggml.scores"),
            add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)),
            unk_token_id=get("tokenizer.ggml.unknown_token_id"),
        )

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (batch encode/decode, offsets)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tokenizer.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tokenizer.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it (`<|im_start|>`) map to their ids.

        `add_special_tokens` adds BOS and EOS only where the model asks for them
        (`add_bos_token`, `add_eos_token`); chat prompts carry their own special tokens from
        the template.
        """
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; a multi-byte character cut off at the end decodes to U+FFFD."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary spellings (byte-level alphabet, e.g. 'Ġthe'); KeyError for an id
        outside the vocabulary."""
        spellings = []
        for token_id in ids:
            spelling = self._tokenizer.id_to_token(token_id)
            if spelling is None:
                raise KeyError(f"token id {token_id} is not in the vocabulary")
            spellings.append(spelling)
        return spellings

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        """The exact bytes each token id stands for (a special token: its spelling), so that
        a grammar can tell which tokens may come next; a byte-level token's characters each
        stand for one byte, a SentencePiece token spells a space "▁" and a byte `<0xAB>`."""
        byte_of = {char: byte for byte, char in byte_alphabet().items()}
        out = []
        for token_id in range(self.vocab_size):
            spelling = self._tokenizer.id_to_token(token_id) or ""
            if token_id in self.special_token_ids:
                out.append(spelling.encode())
            elif self.model == "llama":
                byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", spelling)
                out.append(bytes([int(byte.group(1), 16)]) if byte
                           else spelling.replace(SPACE, " ").encode())
            else:
                out.append(bytes(byte_of.get(c, 0x3F) for c in spelling))
        return out

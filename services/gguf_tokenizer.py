"""A byte-level BPE tokenizer rebuilt from a GGUF file's metadata alone.

A GGUF carries no `tokenizer.json`, only llama.cpp's metadata keys (vocabulary, merges, token
types, special token ids, chat template). We rebuild the `tokenizers.Tokenizer` the model was
trained with from those, so that serving needs neither transformers nor a model hub.

Shared by the stages that read a model's vocabulary (tokenizer, detokenizer), like
model_files.py; no service imports another service's modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from os import PathLike

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens such as <|im_end|>
USER_DEFINED_TOKEN_TYPE = 4  # added tokens matched whole in text, but not special
SUPPORTED_TOKENIZER_MODEL = "gpt2"  # llama.cpp's name for byte-level BPE
# llama.cpp's names (`tokenizer.ggml.pre`) of the pre-tokenizers built here: SmolLM2's, digits
# one by one before byte-level BPE. Llama 3's, Qwen2's and the rest split text differently, so
# serving them with this one would give wrong ids: they are refused by name instead.
SUPPORTED_PRE_TOKENIZERS = ("smollm",)


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


class GGUFTokenizer:
    """Encode/decode with the vocabulary of a GGUF model (byte-level BPE only).

    Matches transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` ids on ordinary
    text. Digits are split one by one before byte-level BPE, as in the SmolLM2 `tokenizer.json`
    and llama.cpp's `smollm` pre-tokenizer; transformers' GGUF loader omits that step, which only
    changes ids for non-ASCII numerals after a space or next to each other (e.g. " ½").
    """

    def __init__(self, *, tokens: Sequence[str], token_types: Sequence[int],
                 merges: Sequence[str], bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None, add_bos_token: bool = False) -> None:
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        # Files should spell every token in the byte alphabet; respell the odd one that is not.
        vocab = {
            tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): index
            for index, tok in enumerate(tokens)
        }
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                         fuse_unk=False)
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tokenizer.decoder = decoders.ByteLevel()
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel (transformers
        # skips those too): adding it would grow the vocabulary past the model's embedding size.
        special = [AddedToken(tok, normalized=False, special=True)
                   for tok, kind in zip(tokens, token_types, strict=True)
                   if kind == CONTROL_TOKEN_TYPE and set(tok) <= alphabet]
        tokenizer.add_special_tokens(special)
        user_defined = [AddedToken(tok, normalized=False, special=False)
                        for tok, kind in zip(tokens, token_types, strict=True)
                        if kind == USER_DEFINED_TOKEN_TYPE and tok in vocab]
        tokenizer.add_tokens(user_defined)

        self._tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.special_token_ids = frozenset(tokenizer.token_to_id(t.content) for t in special)

    @classmethod
    def from_gguf(cls, path: str | PathLike[str]) -> GGUFTokenizer:
        """Read the tokenizer metadata of a GGUF file (the tensors are not loaded)."""
        from gguf import GGUFReader  # numpy + gguf only when a file is actually read

        fields = GGUFReader(path).fields

        def get(key: str, default=None):
            field = fields.get(key)
            return default if field is None else field.contents()

        model = get("tokenizer.ggml.model")
        if model != SUPPORTED_TOKENIZER_MODEL:
            raise UnsupportedTokenizerError(
                f"{path}: tokenizer model {model!r} is not supported; only byte-level BPE "
                f"({SUPPORTED_TOKENIZER_MODEL!r}) GGUF tokenizers can be served")
        pre = get("tokenizer.ggml.pre")
        if pre is not None and pre not in SUPPORTED_PRE_TOKENIZERS:  # absent: files predating
            raise UnsupportedTokenizerError(  # the key, which llama.cpp also serves as is
                f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
        tokens = get("tokenizer.ggml.tokens")
        return cls(
            tokens=tokens,
            token_types=get("tokenizer.ggml.token_type") or [1] * len(tokens),
            merges=get("tokenizer.ggml.merges", []),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_id=get("tokenizer.ggml.eos_token_id"),
            chat_template=get("tokenizer.chat_template"),
            add_bos_token=bool(get("tokenizer.ggml.add_bos_token", False)),
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

        `add_special_tokens` prepends BOS only where the model asks for it (`add_bos_token`);
        chat prompts carry their own special tokens from the template.
        """
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; a multi-byte character cut off at the end decodes to U+FFFD."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary spellings (byte-level alphabet, e.g. 'Ġthe')."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

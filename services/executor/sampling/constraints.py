"""Constrained decoding in the executor: each constrained request's grammar matcher, and the
token masks of a step applied to its logits before sampling.

Compiling a constraint (a matcher over this model's vocabulary) happens ahead of the request's
first step: the scheduler asks for it when the request arrives (GrammarRequest, answered in a
thread of its own), and holds the request back until it is ready. Compiled matchers are cached
by the constraint's text; a request gets a copy. The mask of a step is filled for the
constrained rows only, into one int32 bitmask (bit t of a row: token t allowed), and applied to
a copy of those rows' logits, so the raw logits still give logprobs and unconstrained rows pay
nothing.

A matcher follows its request's tokens: it takes each token the request samples, and nothing
else; a constraint with `after` (a thinking model's `</think>`) takes only the tokens after
that text, so the reasoning is free and the answer constrained (grammar_state.py). A
preempted request keeps its tokens in the executor and is recomputed from them, so its matcher
stays where it was; constrained requests get no speculative drafts, so nothing it took is ever
taken back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance
import structlog
import torch

from llmbus.bus.messages import StructuredOutput
from llmbus.services.structured_output import ConstraintError, check, grammar_of

log = structlog.get_logger()

MAX_CACHED = 256  # compiled constraints kept (least recently used goes first)
_BITS = 1 << torch.arange(32, dtype=torch.int64)  # bit j of a 32-token word


@dataclass
class Vocabulary:
    """What a grammar needs of a tokenizer: the bytes of every token id, which ids are special
    (never text), the end-of-sequence ids, and how text tokenizes (llguidance's interface)."""

    tokens: list[bytes]
    special_token_ids: list[int]
    eos_token_ids: list[int]
    encode: Callable[[str], list[int]]
    bos_token_id: int | None = None

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def __call__(self, text: str | bytes) -> list[int]:
        return self.encode(text.decode("utf-8", errors="replace")
                           if isinstance(text, bytes) else text)

    @classmethod
    def from_gguf(cls, path, vocab_size: int, eos_token_ids: Sequence[int]) -> Vocabulary:
        """The GGUF's own vocabulary, padded with special (never allowed as text) ids up to the
        model's `vocab_size` rows of logits."""
        from llmbus.services.gguf_tokenizer import GGUFTokenizer

        tokenizer = GGUFTokenizer.from_gguf(path)
        tokens = tokenizer.token_bytes()[:vocab_size]
        padding = range(len(tokens), vocab_size)
        return cls(tokens + [b""] * len(padding),
                   sorted({*tokenizer.special_token_ids, *padding}),
                   list(eos_token_ids), tokenizer.encode, tokenizer.bos_token_id)


class Grammars:
    """Compiles constraints for one vocabulary, caches them, and hands out matchers."""

    def __init__(self, vocabulary: Callable[[], Vocabulary], vocab_size: int) -> None:
        """`vocabulary` is called once, by `warm` (the executor calls it in the background at
        start-up) or else on the first constraint."""
        self._vocabulary = vocabulary
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._eos_token_ids: list[int] = []
        self._token_bytes: list[bytes] = []
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor(num_threads=1)
        self.num_words = (vocab_size + 31) // 32

    def _tokenizer_locked(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            vocabulary = self._vocabulary()
            self._eos_token_ids = list(vocabulary.eos_token_ids)
            self._token_bytes = vocabulary.tokens
            self._tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(vocabulary), n_vocab=self.vocab_size,
                eos_token=self._eos_token_ids)
        return self._tokenizer

    def warm(self) -> None:
        """Read the vocabulary now (at start-up, in the background), not on a first request."""
        with self._lock:
            self._tokenizer_locked()

    def prepare(self, structured: StructuredOutput) -> None:
        """Compile `structured` (unless cached); ConstraintError if it does not compile."""
        self._compiled(structured)

    def _compiled(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        key = (structured.kind, structured.spec)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
            try:
                tokenizer = self._tokenizer_locked()
            except Exception as exc:  # a vocabulary this library cannot take
                raise ConstraintError("constrained decoding is not available for this model's "
                                      f"vocabulary: {exc}", structured.param) from exc
        check(structured)  # the grammar's own errors, worded for the client
        matcher = llguidance.LLMatcher(tokenizer, grammar_of(structured), log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"the constraint does not compile: {matcher.get_error()}",
                                  structured.param)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return matcher

    def token_bytes(self, token_id: int) -> bytes:
        """The text a token id stands for (after a matcher was made: the vocabulary is read)."""
        return self._token_bytes[token_id]

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request (compiled now if the cache lost it, e.g. after this
        executor restarted between the scheduler's GrammarRequest and the step)."""
        return self._compiled(structured).deep_copy()

    def bitmask(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        """[R, words] int32: row i's allowed next tokens. A matcher in an error state (it took
        a token its grammar refused, which masking prevents) allows only end of sequence."""
        mask = torch.zeros((len(matchers), self.num_words), dtype=torch.int32)
        ok = [(m, i) for i, m in enumerate(matchers) if not m.is_error()]
        if ok:
            self._executor.unsafe_compute_mask_ptr(ok, mask.data_ptr(), self.num_words * 4,
                                                   len(matchers))
        for i, m in enumerate(matchers):
            if m.is_error():
                log.warning("grammar matcher failed; ending the request",
                            error=m.get_error().splitlines()[0])
                for eos in self._eos_token_ids:
                    mask[i, eos // 32] |= _to_int32(1 << (eos % 32))
        return mask


def _to_int32(bit: int) -> int:
    return bit - (1 << 32) if bit >= 1 << 31 else bit


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 bitmask -> [R, vocab_size] bool, on the bitmask's device."""
    words = bitmask.to(torch.int64)[:, :, None]  # no sign trouble at bit 31
    bits = _BITS.to(bitmask.device)
    return ((words & bits) != 0).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_masks(logits: torch.Tensor, rows: Sequence[int],
                bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] with rows `rows` masked by bitmask [len(rows), words] (disallowed
    tokens -inf): a copy; `logits` is left as it was."""
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    keep = allowed(bitmask.to(logits.device), logits.shape[1])  # 32x less to copy
    masked = logits.index_select(0, index).masked_fill_(~keep, float("-inf"))
    return logits.index_copy(0, index, masked)

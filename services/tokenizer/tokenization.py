"""The tokenizer stage's pure core: prompt text or chat messages to token ids, checked against
the vocabulary. No bus, no spans (the adapter, service.py, records those)."""

from __future__ import annotations

from llmbus.bus.messages import EncodeRequest, GenerateRequest
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.tokenizer.chat_template import render_chat_template


class Tokenization:
    """Prompt text or messages -> token ids, with the model's own template and vocabulary."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer

    def check_token_ids(self, token_ids: list[int], what: str = "token id") -> None:
        bad = [t for t in token_ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad[0]} is outside the vocabulary "
                             f"(0..{self.tokenizer.vocab_size - 1})")

    def prompt_token_ids(self, request: GenerateRequest | EncodeRequest) -> list[int]:
        """Raises ValueError with a client-facing message on bad input."""
        tok = self.tokenizer
        if getattr(request, "prompt_token_ids", None) is not None:
            self.check_token_ids(request.prompt_token_ids)
            return list(request.prompt_token_ids)
        if request.messages:
            if not tok.chat_template:
                raise ValueError("this model has no chat template; use /v1/completions")
            text = render_chat_template(
                tok.chat_template, [{"role": m.role, "content": m.content}
                                    for m in request.messages],
                add_generation_prompt=request.add_generation_prompt,
                bos_token=tok.bos_token, eos_token=tok.eos_token)
            return tok.encode(text)
        return tok.encode(request.prompt or "", add_special_tokens=True)

"""Greedy decoding by HF transformers on the default model's GGUF: the reference the exact mode
is held to (design invariant 3). The model itself is conftest.py's session fixture
`hf_reference`, loaded once per test process."""

from __future__ import annotations


def hf_greedy(hf_reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF `generate`, stopping at eos like the server does."""
    import torch

    tokenizer, model = hf_reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()

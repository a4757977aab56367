"""HF transformers on a GGUF: the reference the exact mode is held to (design invariant 3).
Greedy decoding of the default model (the model itself is conftest.py's session fixture
`hf_reference`, loaded once per test process), and any file transformers loads."""

from __future__ import annotations

from pathlib import Path


def hf_from_gguf(path: Path, family: str):
    """transformers' `<family>ForCausalLM` loading the GGUF itself (float32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    assert type(model).__name__ == f"{family}ForCausalLM"
    return model


def hf_greedy(hf_reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF `generate`, stopping at eos like the server does."""
    import torch

    tokenizer, model = hf_reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()

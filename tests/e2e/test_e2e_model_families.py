"""`llmbus up --model FILE` serves each generated family end to end (tiny random weights with
the default model's vocabulary, or a SentencePiece one): greedy completions come back as the
executor alone computes them."""

from __future__ import annotations

import httpx
import pytest

from llmbus.bus.messages import SamplingParams
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import default_model_path
from tests.gguf_fixtures import TinySpec, generate, write_tiny_llama
from tests.stack import needs_default_model, start_stack, stop_stack
from tests.vocab_fixtures import write_gemma_vocab, write_vocab

pytestmark = [pytest.mark.model, needs_default_model()]

SPEC = TinySpec(vocab_size=49152)
PROMPT = "The river runs past the mill"
MAX_TOKENS = 8


# Each family whose path through the stack differs from the default model's: a scored
# SentencePiece vocabulary, Gemma 3's vocabulary and sliding windows, and experts (another
# backend class). Llama 3's RoPE factors and qwen2's and qwen3's biases and norms, on the
# default model's vocabulary, change only the executor's arithmetic, which
# tests/executor/backends/test_rope_scaling.py and test_model_families.py hold to
# transformers in process.
@pytest.mark.parametrize("family", ["sentencepiece", "gemma3", "qwen3moe"])
def test_a_generated_family_is_served(tmp_path, family):
    path, vocab, spec = tmp_path / f"tiny-{family}.gguf", default_model_path(), SPEC
    if family == "sentencepiece":  # Llama 2 / Mistral style: a scored vocabulary
        vocab = tmp_path / "spm-vocab.gguf"
        write_vocab(vocab)
        spec = TinySpec(vocab_size=len(GGUFTokenizer.from_gguf(vocab).backend.get_vocab(
            with_added_tokens=False)))
    if family == "gemma3":  # Gemma's vocabulary; a window of 8, shorter than the prompt
        vocab = tmp_path / "gemma-vocab.gguf"
        spec = TinySpec(vocab_size=write_gemma_vocab(vocab), num_layers=6, num_heads=2,
                        num_kv_heads=1, head_size=256, tied=True, sliding_window=8)
    if family == "qwen3moe":  # (the torch backend runs it: the backend chosen for experts)
        spec = TinySpec(vocab_size=SPEC.vocab_size, head_size=128, num_experts=4,
                        num_experts_used=2, expert_size=96)
    write_tiny_llama(path, spec, seed=7, quantized="Q8_0", vocab_from=vocab,
                     arch=family if family in ("gemma3", "qwen3moe") else "llama")
    prompt = GGUFTokenizer.from_gguf(path).encode(PROMPT, add_special_tokens=True)
    if family == "gemma3":  # its vocabulary's settings came along: BOS first, no space prefix
        assert prompt[0] == 2 and len(prompt) + MAX_TOKENS > spec.sliding_window
        assert GGUFTokenizer.from_gguf(path).encode(" the") != \
            GGUFTokenizer.from_gguf(path).encode("the")
    runner = ModelRunner(path, model_name="tiny", num_blocks=64, backend="auto")
    want = generate(runner, [prompt], max_tokens=MAX_TOKENS,
                    params=[SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True)])[0]
    stack = start_stack(tmp_path, "--model", str(path), "--no-nats-auth")
    try:
        models = httpx.get(f"{stack.base_url}/models", timeout=30).json()["data"]
        reply = httpx.post(f"{stack.base_url}/completions", timeout=120, json={
            "model": models[0]["id"], "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}).json()
    finally:
        stop_stack(stack)
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    assert reply["choices"][0]["text"] == GGUFTokenizer.from_gguf(path).decode(want)

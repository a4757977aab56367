"""`llmbus up --model FILE` serves a generated family end to end (tiny random weights with a
SentencePiece vocabulary): greedy completions come back as the executor alone computes them."""

from __future__ import annotations

import httpx
import pytest

from llmbus.bus.messages import SamplingParams
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from tests.gguf_fixtures import TinySpec, generate, write_tiny_llama
from tests.stack import start_stack, stop_stack
from tests.vocab_fixtures import write_vocab

pytestmark = pytest.mark.model

PROMPT = "The river runs past the mill"
MAX_TOKENS = 8


# A family whose path through the stack differs from the default model's where no test in
# process follows it: a scored SentencePiece vocabulary, through tokenizer, detokenizer and
# api. (Gemma 3's vocabulary and sliding windows, and experts, were served here too; their
# vocabulary is tests/tokenizer/test_sentencepiece_tokenizer.py's and their arithmetic
# tests/executor/backends/test_model_families.py's, against transformers in process, so their
# two stacks, ~22 s of the suite, went. Llama 3's RoPE factors and qwen2's and qwen3's biases
# and norms are the executor's arithmetic likewise.)
def test_a_sentencepiece_vocabulary_is_served(tmp_path):
    """Llama 2 / Mistral style: a scored vocabulary."""
    path, vocab = tmp_path / "tiny-sentencepiece.gguf", tmp_path / "spm-vocab.gguf"
    write_vocab(vocab)
    spec = TinySpec(vocab_size=len(GGUFTokenizer.from_gguf(vocab).backend.get_vocab(
        with_added_tokens=False)))
    write_tiny_llama(path, spec, seed=7, quantized="Q8_0", vocab_from=vocab)
    prompt = GGUFTokenizer.from_gguf(path).encode(PROMPT, add_special_tokens=True)
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

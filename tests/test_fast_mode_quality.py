"""Design invariant 3: the fast default is measured against the exact mode. Perplexity on a
fixed text (tests/data/perplexity_text.txt, ~2,300 tokens) through each backend's own forward,
prefill in chunks over the paged cache.

The fast mode has three forwards, and each is held to it: llmbus's integer kernel (int_step.py:
every step where it was built, run here in chunks of 8 tokens, whose down projections take
int16 activations, and of 64, whose take int8 ones), ONNX Runtime's int8 graphs (where no
compiler built the kernel), and the bfloat16 GEMMs that big steps take where the CPU has them
(dense_prefill.py; forced on here, so every CPU checks its numerics, slowly where bfloat16 is
emulated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmbus.services.executor.gguf_loader import load_gguf
from llmbus.services.executor.int_step import WIDE_DOWN_TOKENS
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.onnx_model import ACCURACY_EXACT, ACCURACY_FAST, OnnxLlamaModel
from llmbus.services.executor.perplexity import perplexity
from llmbus.services.gguf_tokenizer import GGUFTokenizer
from llmbus.services.model_files import default_model_path

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not default_model_path().is_file(), reason="default model not pulled"),
]

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"


def test_fast_mode_perplexity_is_within_one_percent_of_exact():
    path = default_model_path()
    token_ids = GGUFTokenizer.from_gguf(path).encode(TEXT.read_text())
    assert len(token_ids) >= 2000
    config, dense, native = load_gguf(path, keep_native=True, dense_for_native=False)
    num_blocks = len(token_ids) // 16 + 2
    results = {}
    for name, level, kv_dtype, dense_prefill, int_step, chunk in (
            ("exact", ACCURACY_EXACT, torch.float32, False, False, 256),
            ("fast, int8 graphs", ACCURACY_FAST, torch.float16, False, False, 256),
            ("fast, bfloat16 GEMMs", ACCURACY_FAST, torch.float16, True, False, 256),
            ("fast, integer kernel, small steps", ACCURACY_FAST, torch.float16, False, True,
             WIDE_DOWN_TOKENS),
            ("fast, integer kernel", ACCURACY_FAST, torch.float16, False, True, 64)):
        model = OnnxLlamaModel(config, dense, native, max_positions=len(token_ids),
                               accuracy_level=level, num_threads=2, dense_prefill=dense_prefill,
                               int_step=int_step)
        if (dense_prefill and model.dense_prefill is None) or (
                int_step and model.int_step is None):
            continue  # no C++ compiler, so no such kernel: this path never runs
        results[name] = perplexity(model, KVCache(config, num_blocks, 16, kv_dtype), token_ids,
                                   chunk_size=chunk)
    # a plausible value for a 135M model on plain English prose: the text and path are sane
    assert 5 < results["exact"] < 40
    for name in set(results) - {"exact"}:
        assert abs(results[name] / results["exact"] - 1) < 0.01, results

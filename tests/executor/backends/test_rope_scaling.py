"""RoPE scaling as GGUF files carry it: Llama 3.1+'s per-frequency factors (`rope_freqs`) and
linear scaling, against HF transformers loading the same file (told the scaling it implies,
which its GGUF reader does not read), and a clear refusal of the rest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmbus.services.executor.attention.metadata import build_attention_metadata
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kv_cache import KVCache
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.model_config import UnsupportedModelError
from tests.gguf_fixtures import TinySpec, write_tiny_llama

pytest.importorskip("transformers")

SPEC = TinySpec()
LENGTH = 80  # past the 32-token "original" context below, where the scalings differ most
# Llama 3.1's scheme, shrunk to the tiny model: of its 8 frequencies, the fastest is kept,
# the next smoothed and the rest divided by 8.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _hf(path, rope_parameters: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    model.config.rope_parameters = {"rope_theta": SPEC.rope_theta, **rope_parameters}
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model.eval()


def _ours(path, tokens: list[int]) -> torch.Tensor:
    config, weights, _ = load_gguf(path)
    model = LlamaModel(config, weights, max_positions=128)
    cache = KVCache(config, num_blocks=32, block_size=16)
    meta = build_attention_metadata([len(tokens)], [len(tokens)],
                                    [list(range(1, 1 + -(-len(tokens) // 16)))], 16)
    with torch.inference_mode():
        return model.forward(torch.tensor(tokens), meta.positions, meta, cache,
                             torch.arange(len(tokens)))


def _llama3_factors() -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs: default / scaled frequencies."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=SPEC.hidden_size, num_attention_heads=SPEC.num_heads,
                         rope_parameters={"rope_theta": SPEC.rope_theta, **LLAMA3})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = SPEC.hidden_size // SPEC.num_heads
    default = 1.0 / SPEC.rope_theta ** (torch.arange(0, dim, 2).float() / dim)
    return (default / scaled).numpy()


@pytest.mark.parametrize("scaling", ["llama3", "linear"])
def test_scaled_rope_matches_transformers(tmp_path, scaling):
    path = tmp_path / "m.gguf"
    if scaling == "llama3":
        factors = _llama3_factors()
        assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)
        write_tiny_llama(path, SPEC, seed=5, rope_freqs=factors)
        hf = _hf(path, LLAMA3)
    else:
        write_tiny_llama(path, SPEC, seed=5, rope_scaling=("linear", 4.0))
        hf = _hf(path, {"rope_type": "linear", "factor": 4.0})
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, SPEC.vocab_size, LENGTH)]
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0]
    got = _ours(path, tokens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    unscaled = tmp_path / "plain.gguf"
    write_tiny_llama(unscaled, SPEC, seed=5)
    assert (_ours(unscaled, tokens) - want).abs().max() > 1e-2  # the scaling mattered


def test_other_scalings_and_misshapen_factors_are_refused_by_name(tmp_path):
    write_tiny_llama(tmp_path / "yarn.gguf", SPEC, rope_scaling=("yarn", 4.0))
    with pytest.raises(UnsupportedModelError, match="llama.rope.scaling.type 'yarn'"):
        load_gguf(tmp_path / "yarn.gguf")
    write_tiny_llama(tmp_path / "short.gguf", SPEC, rope_freqs=np.ones(3, dtype=np.float32))
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight has shape"):
        load_gguf(tmp_path / "short.gguf")

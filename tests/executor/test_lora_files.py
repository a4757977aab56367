"""LoRA adapters' files (services/adapter_files.py, weights/lora_files.py): PEFT folders and
llama.cpp GGUF adapters read back to the matrices written, mean what transformers + PEFT
compute, travel as one blob, and are refused in one line where they do not fit.

The meaning is checked on tiny generated models: transformers + PEFT's logits against the base's
with every targeted weight replaced by W + scaling·B·A from OUR LoraWeights, so a wrong scaling,
swapped A/B or a wrong Q/K row order shows as a difference far beyond float32 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmbus.services import safetensors_blob
from llmbus.services.adapter_files import AdapterError, pack_adapter
from llmbus.services.executor.weights.lora_files import LoraWeights, check_fits, read_adapter
from llmbus.services.model_files import default_model_path
from tests.gguf_fixtures import QWEN3_SPEC, TinySpec, write_file, write_tiny_llama
from tests.lora_adapters import (
    base_config,
    hf_model,
    logits,
    merged,
    with_peft,
    write_gguf_adapter,
    write_peft_adapter,
)

SPECS = {"llama": TinySpec(), "qwen3": QWEN3_SPEC}
ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 256, 12)]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bases")
    for arch, spec in SPECS.items():
        write_tiny_llama(folder / f"tiny-{arch}.gguf", spec, seed=3, arch=arch)
    return {arch: folder / f"tiny-{arch}.gguf" for arch in SPECS}


@pytest.fixture(scope="module")
def hf_bases(bases) -> dict[str, torch.nn.Module]:
    pytest.importorskip("peft")
    return {arch: hf_model(path) for arch, path in bases.items()}


def assert_same(got: LoraWeights, want: LoraWeights) -> None:
    assert (got.rank, got.scaling) == (want.rank, want.scaling)
    assert got.matrices.keys() == want.matrices.keys()
    for key, (a, b) in want.matrices.items():
        got_a, got_b = got.matrices[key]
        assert got_a.dtype == got_b.dtype == torch.float32, key
        assert got_a.is_contiguous() and got_b.is_contiguous(), key
        assert torch.equal(got_a, a) and torch.equal(got_b, b), key


def one_line_refusal(call) -> str:
    with pytest.raises(AdapterError) as refused:
        call()
    message = str(refused.value)
    assert message and "\n" not in message
    return message


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_peft_folder_reads_back_as_written(tmp_path, bases, dtype):
    config = base_config(bases["llama"])
    want = write_peft_adapter(tmp_path / "a", config, rank=8, alpha=16, targets=ALL_TARGETS,
                              seed=1, dtype=getattr(torch, dtype))
    got = read_adapter(pack_adapter(tmp_path / "a"), "llama", config)
    assert_same(got, want)
    assert got.scaling == 16 / 8 and got.base_model == "tiny-test"
    assert check_fits(got, config, max_rank=64) == ""


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path, bases):
    config = base_config(bases["llama"])
    write_peft_adapter(tmp_path / "a", config, rank=16, alpha=8, use_rslora=True)
    assert read_adapter(pack_adapter(tmp_path / "a"), "llama", config).scaling == 8 / 4


def rounding_bound(config, num_tokens: int, rank: int, reference: torch.Tensor) -> float:
    """How far two float32 evaluations of the same real-valued forward may drift apart: a dot
    product of length n rounded to nearest is within n·u·Σ|terms| of the exact one (u = 2^-24),
    and each logit ends a chain of such sums (per layer: Q/K/V over the hidden size, Q·K over
    the head, P·V over the tokens, O over the heads' width, gate/up over the hidden size, down
    over the MLP's, each LoRA path over its rank; then the vocabulary head). The sum of those
    lengths times u, times the largest |logit| standing in for Σ|terms|."""
    d, q_width = config.hidden_size, config.num_heads * config.head_dim
    per_layer = (3 * d + config.head_dim + num_tokens + q_width + 2 * d
                 + config.intermediate_size + len(ALL_TARGETS) * rank)
    lengths = config.num_layers * per_layer + d
    return lengths * 2.0 ** -24 * reference.abs().max().item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("source", ["peft", "gguf"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_the_matrices_mean_what_peft_computes(tmp_path, bases, hf_bases, arch, source,
                                              use_rslora):
    config = base_config(bases[arch])
    folder = tmp_path / "adapter"
    written = write_peft_adapter(folder, config, rank=8, alpha=32, targets=ALL_TARGETS, seed=2,
                                 use_rslora=use_rslora)
    # llama.cpp scales by alpha / r, rslora or not: the GGUF's alpha is what makes it PEFT's
    blob = pack_adapter(folder) if source == "peft" else pack_adapter(write_gguf_adapter(
        tmp_path / "adapter.gguf", written, arch, written.scaling * 8, config))
    ours = read_adapter(blob, arch, config)
    peft = with_peft(hf_bases[arch], folder)
    want = logits(peft, PROMPT)
    got = logits(merged(hf_bases[arch], ours), PROMPT)
    bound = rounding_bound(config, len(PROMPT), 8, want)
    assert (got - want).abs().max().item() <= bound
    # ... and the adapter matters far beyond that bound, so the comparison can fail
    assert (logits(hf_bases[arch], PROMPT) - want).abs().max().item() > 1000 * bound


def test_the_files_are_named_as_peft_saves_them(tmp_path, bases, hf_bases):
    from peft import get_peft_model_state_dict

    write_peft_adapter(tmp_path / "a", bases["llama"], targets=ALL_TARGETS)
    peft = with_peft(hf_bases["llama"], tmp_path / "a")
    theirs = get_peft_model_state_dict(peft, save_embedding_layers=False)
    entries, _, _ = safetensors_blob.read_header((tmp_path / "a/adapter_model.safetensors")
                                                 .read_bytes())
    assert set(theirs) == set(entries)  # e.g. `...q_proj.lora_A.weight`, no `.default.`


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(("tensor_type", "dtype"), [("F32", "float32"), ("F16", "float16")])
def test_a_gguf_adapter_reads_back_as_written(tmp_path, bases, arch, tensor_type, dtype):
    config = base_config(bases[arch])
    want = write_peft_adapter(tmp_path / "a", config, rank=4, alpha=8, targets=ALL_TARGETS,
                              seed=4, dtype=getattr(torch, dtype))
    path = write_gguf_adapter(tmp_path / "a.gguf", want, arch, 8, config, tensor_type)
    got = read_adapter(pack_adapter(path), arch, config)
    assert_same(got, want)
    stored_b = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.attn_q.weight.lora_b"]
    rows_as_hf = np.array_equal(stored_b.data.astype(np.float32), want.matrices[0, "q"][1].numpy())
    assert rows_as_hf == (arch != "llama")  # a llama file's Q rows are llama.cpp's


def test_gguf_scaling_is_alpha_over_rank_and_one_without_alpha(tmp_path, bases):
    config = base_config(bases["llama"])
    weights = write_peft_adapter(tmp_path / "a", config, rank=4, alpha=8, targets=("v",))
    for alpha, scaling in ((8, 2.0), (0, 1.0)):
        path = write_gguf_adapter(tmp_path / f"{alpha}.gguf", weights, "llama", alpha, config)
        assert read_adapter(path.read_bytes(), "llama", config).scaling == scaling


def test_a_packed_folder_is_one_safetensors_blob(tmp_path, bases):
    from safetensors import safe_open

    config = base_config(bases["llama"])
    want = write_peft_adapter(tmp_path / "a", config, targets=("q", "down"))
    blob = pack_adapter(tmp_path / "a")
    (tmp_path / "blob.safetensors").write_bytes(blob)
    with safe_open(tmp_path / "blob.safetensors", "pt") as f:  # the reference reader takes it
        assert json.loads(f.metadata()["adapter_config"]) == json.loads(
            (tmp_path / "a/adapter_config.json").read_text())
        assert torch.equal(f.get_tensor("base_model.model.model.layers.1.mlp.down_proj"
                                        ".lora_B.weight"), want.matrices[1, "down"][1])
    assert_same(read_adapter(blob, "llama", config), want)
    gguf_path = write_gguf_adapter(tmp_path / "a.gguf", want, "llama", 16, config)
    assert pack_adapter(gguf_path) == gguf_path.read_bytes()


REFUSED_CONFIGS = [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ({"target_modules": ["embed_tokens", "v_proj"]}, "embed_tokens"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "IA3"),
]


@pytest.mark.parametrize(("change", "named"), REFUSED_CONFIGS)
def test_adapter_configs_it_cannot_serve_are_refused(tmp_path, bases, change, named):
    config = base_config(bases["llama"])
    write_peft_adapter(tmp_path / "a", config, config_changes=change)
    assert named in one_line_refusal(lambda: pack_adapter(tmp_path / "a"))
    # a blob packed elsewhere is refused on reading too
    text = (tmp_path / "a/adapter_config.json").read_text()
    blob = safetensors_blob.with_metadata(
        (tmp_path / "a/adapter_model.safetensors").read_bytes(), "adapter_config", text)
    assert named in one_line_refusal(lambda: read_adapter(blob, "llama", config))


def test_tensors_beyond_the_seven_projections_are_refused(tmp_path, bases):
    from safetensors.torch import save_file

    config = base_config(bases["llama"])
    write_peft_adapter(tmp_path / "a", config, targets=("q",))
    path = tmp_path / "a/adapter_model.safetensors"
    tensors = {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.lm_head.lora_B.weight": torch.ones(256, 8)}
    save_file(tensors, str(path))
    message = one_line_refusal(lambda: read_adapter(pack_adapter(tmp_path / "a"), "llama",
                                                    config))
    assert "lm_head" in message


def test_what_is_no_adapter_is_refused(tmp_path, bases):
    config = base_config(bases["llama"])
    noise = np.random.default_rng(0).bytes(4096)
    assert "not a LoRA adapter" in one_line_refusal(lambda: read_adapter(noise, "llama", config))
    (tmp_path / "noise.bin").write_bytes(noise)
    assert "neither" in one_line_refusal(lambda: pack_adapter(tmp_path / "noise.bin"))
    model = tmp_path / "model.gguf"  # a base model, as convert_hf_to_gguf.py marks one
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_tensor("blk.0.attn_q.weight", np.ones((4, 4), np.float32))
    write_file(writer)
    for blob in (model.read_bytes(), bases["llama"].read_bytes()):  # typed, and untyped
        message = one_line_refusal(lambda blob=blob: read_adapter(blob, "llama", config))
        assert "general.type" in message
    assert "general.type is 'model'" in one_line_refusal(lambda: pack_adapter(model))


def test_a_gguf_adapter_of_another_architecture_is_refused(tmp_path, bases):
    config = base_config(bases["llama"])
    weights = write_peft_adapter(tmp_path / "a", config, targets=("v",))
    path = write_gguf_adapter(tmp_path / "a.gguf", weights, "qwen2", 16, config)
    message = one_line_refusal(lambda: read_adapter(path.read_bytes(), "llama", config))
    assert "'qwen2'" in message and "'llama'" in message


def test_half_a_pair_and_mixed_ranks_are_refused(tmp_path, bases):
    config = base_config(bases["llama"])
    weights = write_peft_adapter(tmp_path / "a", config, rank=4, targets=("q", "v"))
    a, _ = weights.matrices[0, "v"]
    weights.matrices[0, "v"] = (a[:2].contiguous(), torch.ones(config.hidden_size // 2, 2))
    path = write_gguf_adapter(tmp_path / "mixed.gguf", weights, "llama", 8, config)
    assert "different ranks" in one_line_refusal(
        lambda: read_adapter(path.read_bytes(), "llama", config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "a/adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, str(tmp_path / "a/adapter_model.safetensors"))
    message = one_line_refusal(lambda: read_adapter(pack_adapter(tmp_path / "a"), "llama",
                                                    config))
    assert message == "layer 1 q: lora_A without its other half"


def test_what_does_not_fit_the_base_is_named(tmp_path, bases):
    config = base_config(bases["llama"])
    write_peft_adapter(tmp_path / "r16", config, rank=16, targets=("q",))
    wide = read_adapter(pack_adapter(tmp_path / "r16"), "llama", config)
    assert check_fits(wide, config, max_rank=16) == ""
    assert check_fits(wide, config, max_rank=8) == "rank 16 is over --max-lora-rank 8"
    other = TinySpec(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    write_tiny_llama(tmp_path / "other.gguf", other)
    write_peft_adapter(tmp_path / "other", tmp_path / "other.gguf", rank=4, targets=("down",))
    misfit = read_adapter(pack_adapter(tmp_path / "other"), "llama", config)
    assert check_fits(misfit, config, max_rank=64) == (
        "layer 0 down: expected A [r, 128] and B [64, r], got A [4, 64] and B [32, 4]")
    write_peft_adapter(tmp_path / "deep", config, targets=("q", "o"), layers=[0, 5])
    deep = read_adapter(pack_adapter(tmp_path / "deep"), "llama", config)
    assert check_fits(deep, config, max_rank=64) == "layer 5 q: the base has 2 layers"


@pytest.mark.model
def test_the_default_model_takes_a_generated_adapter(tmp_path):
    """The adapter the issue's end-to-end checks use: rank 8 on q, v, gate, down."""
    if not default_model_path().is_file():
        pytest.skip("default model not pulled (`llmbus model pull`)")
    config = base_config(default_model_path())
    want = write_peft_adapter(tmp_path / "a", default_model_path(), rank=8, alpha=16)
    got = read_adapter(pack_adapter(tmp_path / "a"), "llama", config)
    assert_same(got, want)
    assert check_fits(got, config, max_rank=64) == ""
    assert len(got.matrices) == 4 * config.num_layers

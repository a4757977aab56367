"""LoRA adapters through whole forwards: the torch backend with an adapter equals the base with
the adapter merged into its weights (W + s·B·A); the integer kernel with adapters is as close
to that as its own arithmetic allows; the base's rows are untouched by adapters beside them in
the same steps; and the runner serves adapters only where it can."""

from __future__ import annotations

import pytest
import torch

from llmbus.bus.messages import SamplingParams
from llmbus.services.executor.backend_choice import choose_backend
from llmbus.services.executor.backends.cpu_llama import CpuLlamaModel
from llmbus.services.executor.backends.torch_llama import LlamaModel
from llmbus.services.executor.kernels.cpu.library import load_library
from llmbus.services.executor.lora.adapter_slots import AdapterSlots
from llmbus.services.executor.runner import ModelRunner
from llmbus.services.executor.weights.gguf_loader import load_gguf
from llmbus.services.executor.weights.lora_files import LoraWeights
from llmbus.services.executor.weights.model_config import LlamaConfig
from llmbus.services.model_files import default_model_path
from tests.gguf_fixtures import QWEN3_SPEC, TinySpec, generate, write_tiny_llama
from tests.int_kernel_emulation import decode_logits, emulated_linear
from tests.lora_adapters import peft_greedy, write_gguf_adapter, write_peft_adapter

needs_compiler = pytest.mark.skipif(load_library() is None, reason="no C++ compiler here")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def random_adapter(config: LlamaConfig, rank: int, targets: str, seed: int,
                   strength: float = 1.0) -> LoraWeights:
    """An adapter whose deltas are about `strength` times the size of the base's outputs for
    unit inputs (trained adapters change greedy output; a zero B, PEFT's start, would not)."""
    gen = torch.Generator().manual_seed(seed)
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "gate": (f, d),
              "up": (f, d), "down": (d, f)}
    matrices = {}
    for layer in range(config.num_layers):
        for target in targets.split(","):
            out, inp = shapes[target]
            a = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            b = torch.randn(out, rank, generator=gen) * strength / rank ** 0.5
            matrices[layer, target] = (a, b)
    return LoraWeights(rank=rank, scaling=16 / rank, matrices=matrices)


def merge(model: LlamaModel, adapter: LoraWeights) -> None:
    """W += s·B·A in the torch model's stacked weights: the adapter as part of the base."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    f = cfg.intermediate_size
    rows = {"q": ("qkv", 0, q), "k": ("qkv", q, q + kv), "v": ("qkv", q + kv, q + 2 * kv),
            "o": ("attn_output", 0, cfg.hidden_size), "gate": ("gate_up", 0, f),
            "up": ("gate_up", f, 2 * f), "down": ("down", 0, cfg.hidden_size)}
    for (layer, target), (a, b) in adapter.matrices.items():
        name, start, end = rows[target]
        getattr(model.layers[layer], name)[start:end] += adapter.scaling * (b @ a)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "tiny.gguf"
    write_tiny_llama(path, TinySpec(num_layers=3), seed=5, quantized="Q8_0")
    return path


def _runner(path, backend: str, **options) -> ModelRunner:
    choice = choose_backend(path, backend=backend, exact=backend == "torch", adapters=True)
    return ModelRunner(path, model_name="tiny", choice=choice, block_size=4, num_blocks=96,
                       max_adapters=2, **options)


def test_an_adapter_on_the_torch_backend_is_the_base_with_it_merged(tiny):
    runner = _runner(tiny, "torch")
    adapter = random_adapter(runner.config, 8, "q,k,v,o,gate,up,down", seed=1)
    assert runner.adapters is not None and runner.adapters.prepare("tuned", adapter) == ""
    prompts = [[5, 9, 17, 33, 65, 129, 7], [11, 3, 200, 41], [5, 9, 17, 33, 65, 129, 7]]
    tuned = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, adapter="tuned")
    mixed = generate(runner, prompts, max_tokens=12, params=[tuned, GREEDY, GREEDY],
                     chunk_size=3)
    merged = _runner(tiny, "torch")
    merge(merged.model, adapter)
    assert generate(merged, prompts[:1], max_tokens=12) == mixed[:1]
    base = generate(_runner(tiny, "torch"), prompts[1:], max_tokens=12)
    assert mixed[1:] == base  # the base's requests, stepped beside the adapter's
    assert mixed[0] != mixed[2]  # the adapter changed the output


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_output_with_an_adapter_equals_transformers_with_peft(arch, tmp_path):
    """The exact mode's promise with an adapter, in process: the PEFT folder as read from disk,
    and the same adapter as a llama.cpp GGUF adapter, each give transformers + PEFT's tokens."""
    from llmbus.services.adapter_files import pack_adapter
    from llmbus.services.executor.weights.lora_files import read_adapter

    path = tmp_path / f"{arch}.gguf"
    write_tiny_llama(path, QWEN3_SPEC if arch == "qwen3" else TinySpec(), seed=3, arch=arch)
    runner = _runner(path, "torch")
    folder = tmp_path / "adapter"
    weights = write_peft_adapter(folder, path, rank=8, targets=("q", "k", "v", "o", "gate",
                                                                  "up", "down"), seed=4)
    as_gguf = write_gguf_adapter(tmp_path / "adapter.gguf", weights, arch, alpha=16,
                                 config=runner.config)
    for name, source in (("folder", folder), ("gguf", as_gguf)):
        read = read_adapter(pack_adapter(source), arch, runner.config)
        assert runner.adapters is not None and runner.adapters.prepare(name, read) == ""
    prompt = [5, 9, 17, 33, 65, 129, 7, 3]
    expected = peft_greedy(path, folder, prompt, 10)
    eos = tuple(runner.config.eos_token_ids)
    got = generate(runner, [prompt] * 3, max_tokens=10, stop_token_ids=eos, params=[
        SamplingParams(temperature=0.0, adapter=a) for a in ("folder", "gguf", "")])
    assert got[0] == got[1] == expected and len(expected) >= 4, (got, expected)
    assert got[2] != expected  # the base alone answers otherwise


@pytest.fixture(scope="module")
def default_model():
    if not default_model_path().is_file():
        pytest.skip("default model not pulled")
    return load_gguf(default_model_path(), keep_native=True, dense_for_native=False)


def _adapter_slots(config: LlamaConfig) -> AdapterSlots:
    slots = AdapterSlots(config, 2, max_rank=64)
    assert slots.prepare("tuned", random_adapter(config, 8, "q,v,o,gate,down", seed=2,
                                                 strength=0.3)) == ""
    return slots


def _odd_tuned(s: int) -> str:
    return "tuned" if s % 2 else ""


@pytest.mark.model
@needs_compiler
def test_adapters_in_the_integer_kernel_are_as_close_to_exact_as_its_arithmetic(default_model):
    """Judged as test_int_step judges the kernel: its distance from the exact forward (here
    the torch backend's, the adapter added in float32) against the same int8/int16 rounding
    done in torch with the same float32 deltas, both draws of one noise. A delta on the wrong
    rows, layer or scale is far outside it. The base's rows, odd and even sequences apart,
    are the very bits a step without adapters gives."""
    config, dense, native = default_model
    kernel = CpuLlamaModel(config, dense, native, max_positions=64, integer_kernel=True,
                           num_threads=2)
    _, dense_weights, _ = load_gguf(default_model_path())
    exact_model = LlamaModel(config, dense_weights, max_positions=64)
    emulated_model = LlamaModel(config, dense_weights, max_positions=64)
    emulated_model.linear = emulated_linear(emulated_model)
    slots = _adapter_slots(config)
    exact = decode_logits(exact_model, config, torch.float32, slots, _odd_tuned)
    emulated = decode_logits(emulated_model, config, torch.float16, slots, _odd_tuned)
    got = decode_logits(kernel, config, torch.float16, slots, _odd_tuned)

    def distance(logits: torch.Tensor) -> torch.Tensor:
        return 1 - torch.nn.functional.cosine_similarity(exact, logits, dim=-1)

    noise = distance(emulated).median()
    assert noise > 0
    assert distance(got).median() <= 1.5 * noise, (distance(got), noise)
    plain = decode_logits(kernel, config, torch.float16)
    rows = torch.tensor([s % 2 == 0 for s in _decoded_sequences()])
    assert torch.equal(got[rows], plain[rows])
    assert not torch.allclose(got[~rows], plain[~rows])


def _decoded_sequences() -> list[int]:
    """Which sequence each row of decode_logits is: steps of 1 and of 12, four times."""
    return [s for batch in [1, 12] * 4 for s in range(batch)]


def test_the_runner_serves_adapters_only_where_it_can(tiny, tmp_path):
    with pytest.raises(ValueError, match="ONNX Runtime"):
        choose_backend(tiny, backend="onnxruntime", adapters=True)
    exact = choose_backend(tiny, exact=True, adapters=True)
    assert exact.backend == "torch" and exact.exact and "LoRA" in (exact.note or "")
    plain = ModelRunner(tiny, model_name="tiny", block_size=4, num_blocks=16)
    assert plain.adapters is None and plain.info().max_adapters == 0
    tuned = SamplingParams(temperature=0.0, max_tokens=2, adapter="tuned")
    with pytest.raises(AssertionError, match="serves none"):
        generate(plain, [[5, 6]], max_tokens=2, params=[tuned])
